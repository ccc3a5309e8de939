# watermill-inbox: the two commands of the README are `make demo` and `make test`.
# Modules: the root (the library, cmd/, tests/) and three that keep an emulator or a benchmark
# tool out of the root go.mod: adapters/sqs/sqstest (goaws, the sqs adapter's tests),
# examples/billing (the demo) and tests/bench (River, golang.org/x/perf). Each has a replace
# directive to this checkout.
GO     ?= go
MODULES = adapters/sqs/sqstest examples/billing tests/bench
BROKER ?= postgres
MODE   ?= immediate

.PHONY: demo test test-short bench services vet rules bench-relay soak

## demo: the main job: real messages through a real broker, real duplicates, real crashes,
## verified balances (BROKER=postgres|amqp|kafka|sqs|nats|redis; kafka and sqs run in-process;
## MODE=immediate|store-then-process, the inbox mode; DB=pgsql|mysql, the database and store:
## unset, pgstore on PostgreSQL; pgsql, sqlstore's PostgreSQL dialect; mysql, sqlstore's MySQL
## dialect on MariaDB at INBOX_MYSQL_DSN, with a broker other than postgres, e.g. BROKER=amqp;
## SHARDS=3, the accounts split over three PostgreSQL databases, account mod 3, one consumer
## over all of them, pgstore and the immediate mode only).
DB ?=
SHARDS ?=
demo:
	cd examples/billing && $(GO) run . -broker=$(BROKER) -mode=$(MODE)$(if $(DB), -db=$(DB))$(if $(SHARDS), -shards=$(SHARDS))

## test: vet, then every test against the real PostgreSQL, RabbitMQ, NATS and Redis, with the race
## detector, including the two that restart the machine's PostgreSQL cluster and RabbitMQ node
## (INBOX_TEST_RESTART_SERVICES=1; a plain `go test ./...` skips them). Packages run one at a
## time (-p 1): a restart must not overlap with another package's tests. Then the tests of the
## other modules: the sqs adapter and the router on goaws, and tests/bench's (the chart's; its
## benchmarks run only with the bench-* targets). The alert rules' unit tests (rules) run first.
test: vet rules
	INBOX_TEST_RESTART_SERVICES=1 $(GO) test -race -count=1 -p 1 -timeout 20m ./...
	cd adapters/sqs/sqstest && $(GO) test -race -count=1 -p 1 -timeout 10m ./...
	cd tests/bench && $(GO) test -race -count=1 -timeout 5m ./...
	# The RabbitMQ restart test, built without -race: the reconnect of watermill-amqp v3.0.2
	# has a data race of its own (see tests/rabbitrestart_test.go).
	INBOX_TEST_RESTART_SERVICES=1 $(GO) test -count=1 -timeout 5m -run '^TestRabbitMQRestartMidStream$$' ./tests/

## test-short: the tier that needs no service (unit tests, configuration, in-process Kafka and SQS).
test-short:
	$(GO) test -short -count=1 ./...
	cd adapters/sqs/sqstest && $(GO) test -short -count=1 ./...
	cd tests/bench && $(GO) test -short -count=1 ./...

vet:
	$(GO) vet ./...
	for m in $(MODULES); do (cd $$m && $(GO) vet ./...) || exit 1; done

## rules: check the Prometheus alert and recording rules and run their unit tests (promtool,
## from Debian's prometheus package; `make services` installs it when it is missing).
PROMTOOL ?= promtool
rules:
	$(PROMTOOL) check rules deploy/prometheus/inbox.rules.yml
	cd deploy/prometheus && $(PROMTOOL) test rules inbox.rules_test.yml

## bench: the inbox against a bare transaction, at 1, 8 and 32 concurrent deliveries.
bench:
	$(GO) test ./middleware/inbox -run '^$$' -bench InboxVsBareTx -benchtime 3000x -count 3

## services: start PostgreSQL, RabbitMQ, Redis and NATS (JetStream) when they are down.
services:
	bash .ci/services

.PHONY: bench-purge
## bench-purge: claim latency p50/p99 while 1,000,000 expired rows are purged, against without
## (docs/benchmarks.md, "Purge under claims").
bench-purge:
	$(GO) test ./middleware/pgstore -run '^$$' -bench PurgeUnderClaims -benchtime 1x -count 3 -timeout 15m
## bench-relay: the outbox relay's msg/s against its consumer's, per broker (about 100 s).
bench-relay:
	$(GO) test ./tests -run '^$$' -bench RelayVsConsumer -benchtime 1500x -timeout 10m

## soak: the billing consumer SIGKILLed every 5-20 s over 100,000 payments (long; never in CI).
soak:
	cd examples/billing && $(GO) run . -broker=$(BROKER) -soak -messages=100000 -timeout=2h
.PHONY: bench-drain bench-peers bench-chart bench-cost bench-stp

## bench-drain: per broker, the drain of a pre-published backlog: no database (raw), a bare
## transaction, the inbox, the inbox with a dead-letter topic (tests/bench; about 3 minutes on
## 2 busy cores; docs/benchmarks.md "Per broker: draining a backlog").
BACKLOG ?= 2000
bench-drain:
	cd tests/bench && $(GO) test . -run '^$$' -bench BacklogDrain -benchtime 1x -count 3 -backlog $(BACKLOG)

## bench-peers: Watermill's Deduplicator, the bare transaction and the inbox on GoChannel at 1,
## 8, 32 and 128 concurrent deliveries; keeps the output in docs/img/peers.txt and redraws
## docs/img/throughput.svg from it.
bench-peers:
	cd tests/bench && $(GO) test . -run '^$$' -bench Peers -benchtime 2000x -count 3 | tee ../../docs/img/peers.txt
	$(MAKE) bench-chart

## bench-chart: redraw docs/img/throughput.svg from the kept output of bench-peers.
bench-chart:
	cd tests/bench && $(GO) run ./cmd/benchchart -in ../../docs/img/peers.txt -out ../../docs/img/throughput.svg

## bench-cost: what the middleware itself costs per delivery (no I/O store): time,
## allocations and bytes, and a CPU profile of the 8-delivery benchmark on PostgreSQL.
bench-cost:
	$(GO) test ./middleware/inbox -run '^$$' -bench MiddlewareCost -benchmem -count 3
	$(GO) test ./middleware/inbox -run '^$$' -bench 'InboxVsBareTx/deliveries=8$$' -benchtime 3000x -cpuprofile cpu.out -o inbox.test
	$(GO) tool pprof -top -nodecount 30 inbox.test cpu.out

## bench-stp: store-then-process (middleware/deferred) against River (a unique job per message,
## worked by River's workers), with the immediate inbox as the reference row, at 1, 8, 32 and
## 128 deliveries: msg/s, ratio-deferred-river, end-to-end p50/p99 of both.
bench-stp:
	cd tests/bench && $(GO) test . -run '^$$' -bench StoreThenProcess -benchtime 1000x -count 3

.PHONY: bench-recovery bench-vacuum
## bench-recovery: per broker, how long a consumer group stands still after a consumer process is
## SIGKILLed: seconds from the kill to the successor's first and last commit (first-s, all-s;
## docs/operations.md "A killed consumer"). The nats and redis "defaults" cases wait out the
## adapters' default redelivery timeouts (minutes).
RECOVERY_BROKERS ?= amqp postgres kafka nats redis
bench-recovery:
	for b in $(RECOVERY_BROKERS); do \
		$(GO) test ./adapters/$$b -run '^$$' -bench RecoveryAfterSIGKILL -timeout 15m || exit 1; \
	done

## bench-vacuum: table sizes and dead tuples after rounds of VACUUM_N deliveries, with and without
## an explicit VACUUM (CHURN lines; docs/operations.md "Tables that churn, and vacuum"). The
## CHURN lines of go test's first run (b.N = 1) come first: read the last block.
VACUUM_N ?= 20000
bench-vacuum:
	$(GO) test ./tests -run '^$$' -bench TableChurnAndVacuum -benchtime $(VACUUM_N)x -timeout 20m -v
