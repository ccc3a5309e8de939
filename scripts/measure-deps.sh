#!/usr/bin/env bash
# Measures what a user's RabbitMQ-only consumer pulls in from this module (docs/modules.md):
#   A: imports middleware/inbox, middleware/pgstore and adapters/amqp;
#   R: imports middleware/inbox, middleware/pgstore and package router (broker "amqp").
# For each: packages linked (go list -deps), modules providing them, heavy names among them,
# the binary's size; then `go mod tidy` in a scratch user module (replace => this checkout),
# into an empty module cache, counting the go.mod files and module zips it fetched.
# Usage: scripts/measure-deps.sh [A|R]...   (default: A R). Needs the module proxy, or a module
# cache that holds every module (GOPROXY may point at file://$(go env GOMODCACHE)/cache/download).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
variants=("$@"); [ ${#variants[@]} -eq 0 ] && variants=(A R)

program() { # $1 = A|R
	local imp use
	if [ "$1" = A ]; then
		imp='"github.com/watermill-inbox/watermill-inbox/adapters/amqp"'
		use='b, _ := amqp.New(amqp.Config{URL: "amqp://"}, nil)
	fields := b.BrokerSideFields'
	else
		imp='"github.com/watermill-inbox/watermill-inbox/router"'
		use='r, _ := router.New(router.Config{Broker: "amqp", URL: "amqp://"}, pool, nil)
	fields := r.Broker.BrokerSideFields'
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
	heavy=$(go list -deps "$pkg" | grep -Eo 'aws-sdk-go-v2|goaws|kfake|sarama|cobra|nats-io|go-redis|watermill-sql|^testing$' | sort | uniq -c | tr -s ' ' | tr '\n' ';' || true)
	go build -o "$dir/bin" "$pkg"
	size=$(stat -c %s "$dir/bin")
	echo "$v: packages=$all non-std=$nonstd modules=$mods binary=${size}B heavy=[${heavy:-none}]"

	user=$(mktemp -d); cache=$(mktemp -d)
	program "$v" > "$user/main.go"
	printf 'module example.com/user\n\ngo 1.26.0\n\nrequire github.com/watermill-inbox/watermill-inbox v0.0.0\n\nreplace github.com/watermill-inbox/watermill-inbox => %s\n' "$repo" > "$user/go.mod"
	(cd "$user" && GOMODCACHE=$cache GOFLAGS=-mod=mod GOSUMDB=off GOWORK=off go mod tidy 2>/dev/null)
	mf=$(find "$cache/cache/download" -name '*.mod' | wc -l)
	zf=$(find "$cache/cache/download" -name '*.zip' | wc -l)
	zb=$(find "$cache/cache/download" -name '*.zip' -printf '%s\n' | awk '{s+=$1} END {print int(s/1048576)}')
	heavyz=$(find "$cache/cache/download" -name '*.zip' | grep -Eo 'aws-sdk-go-v2|goaws|kfake|sarama|cobra' | sort -u | tr '\n' ' ' || true)
	echo "$v: go mod tidy fetched go.mod=$mf zips=$zf (${zb} MiB) heavy zips=[${heavyz:-none}]; user go.mod requires=$(grep -c '^\s' "$user/go.mod") go.sum lines=$(wc -l < "$user/go.sum")"
	chmod -R u+w "$cache"; rm -rf "$user" "$cache" "$dir"
done
