#!/usr/bin/env bash
# Measures what a user's RabbitMQ consumer pulls in from this module (docs/modules.md):
#   A: imports middleware/inbox, middleware/pgstore and adapters/amqp alone;
#   S: a service on adapters/amqp without package router: A plus middleware/outbox (and its
#      relay), middleware/inboxmetrics (Prometheus) and middleware/health;
#   R: the same service on package router (broker "amqp", registered by importing adapters/amqp).
# For each: packages linked (go list -deps), modules providing them, heavy names among them,
# the binary's size; then `go mod tidy` in a scratch user module (replace => this checkout),
# into an empty module cache, counting the go.mod files and module zips it fetched, and the
# modules in the user's go.sum.
# Usage: scripts/measure-deps.sh [A|S|R]...   (default: A S R). Needs the module proxy, or a
# module cache that holds every module (GOPROXY may point at file://$(go env GOMODCACHE)/cache/download).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
variants=("$@"); [ ${#variants[@]} -eq 0 ] && variants=(A S R)

program() { # $1 = A|S|R
	local imp use svc=""
	case "$1" in
	A | S)
		imp='"github.com/watermill-inbox/watermill-inbox/adapters/amqp"'
		use='b, _ := amqp.New(amqp.Config{URL: "amqp://"}, nil)
	fields, pub := b.BrokerSideFields, b.Publisher'
		;;
	R)
		imp='_ "github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/router"'
		use='r, _ := router.New(router.Config{Broker: "amqp", URL: "amqp://"}, pool, nil)
	fields, pub := r.Broker.BrokerSideFields, r.Broker.Publisher'
		;;
	*)
		echo "unknown variant $1 (A, S or R)" >&2
		exit 2
		;;
	esac
	if [ "$1" != A ]; then
		imp="$imp"'
	"github.com/prometheus/client_golang/prometheus"
	"github.com/watermill-inbox/watermill-inbox/middleware/health"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxmetrics"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"'
		svc='ob, _ := outbox.New(outbox.Config{Topic: "receipts"}, nil)
	relay, _ := outbox.NewRelay(outbox.RelayConfig{Pool: pool, Publisher: pub}, nil)
	m, _ := inboxmetrics.New(prometheus.NewRegistry(), inboxmetrics.Options{})
	ready := health.NewReadiness(health.Config{})
	_, _, _ = relay, m.Outbox(ob), ready'
	fi
	cat <<EOF
package main

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"

	$imp
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

func main() {
	pool, _ := pgxpool.New(context.Background(), "")
	store, _ := pgstore.New(pool, pgstore.Config{})
	$use
	_ = pub
	$svc
	_, _ = inbox.New(inbox.Config{Store: store, ConsumerName: "x", BrokerSideFields: fields}, nil)
}
EOF
}

for v in "${variants[@]}"; do
	dir=$(mktemp -d "$repo/zz_measure_XXXX")
	program "$v" > "$dir/main.go"
	pkg=./$(basename "$dir")
	all=$(go list -deps "$pkg" | wc -l)
	nonstd=$(go list -deps -f '{{if not .Standard}}{{.ImportPath}}{{end}}' "$pkg" | grep -vc "zz_measure" || true)
	mods=$(go list -deps -f '{{with .Module}}{{.Path}}{{end}}' "$pkg" | sort -u | grep -vc '^github.com/watermill-inbox/watermill-inbox$' || true)
	heavy=$(go list -deps "$pkg" | grep -Eo 'aws-sdk-go-v2|goaws|kfake|sarama|cobra|nats-io|go-redis|watermill-sql|riverqueue|prometheus/client_golang|^testing$' | sort | uniq -c | tr -s ' ' | tr '\n' ';' || true)
	go build -o "$dir/bin" "$pkg"
	size=$(stat -c %s "$dir/bin")
	echo "$v: packages=$all non-std=$nonstd modules=$mods binary=${size}B heavy=[${heavy:-none}]"

	user=$(mktemp -d); cache=$(mktemp -d)
	program "$v" > "$user/main.go"
	printf 'module example.com/user\n\ngo 1.26.0\n\nrequire github.com/watermill-inbox/watermill-inbox v0.0.0\n\nreplace github.com/watermill-inbox/watermill-inbox => %s\n' "$repo" > "$user/go.mod"
	(cd "$user" && GOMODCACHE=$cache GOFLAGS=-mod=mod GOSUMDB=off GOWORK=off go mod tidy 2>/dev/null)
	mf=$(find "$cache/cache/download" -name '*.mod' | wc -l)
	zf=$(find "$cache/cache/download" -name '*.zip' | wc -l)
	zb=$(find "$cache/cache/download" -name '*.zip' -printf '%s\n' | awk '{s+=$1} END {printf "%.1f", s/1048576}')
	heavyz=$(find "$cache/cache/download" -name '*.zip' | grep -Eo 'aws-sdk-go-v2|goaws|kfake|sarama|cobra|riverqueue|x/perf|nats-io|go-redis|watermill-sql|prometheus' | sort -u | tr '\n' ' ' || true)
	summods=$(awk '{print $1}' "$user/go.sum" | sort -u | wc -l)
	echo "$v: go mod tidy fetched go.mod=$mf zips=$zf (${zb} MiB) heavy zips=[${heavyz:-none}]; user go.mod requires=$(grep -c '^\s' "$user/go.mod") go.sum lines=$(wc -l < "$user/go.sum") go.sum modules=$summods"
	chmod -R u+w "$cache"; rm -rf "$user" "$cache" "$dir"
done
