# watermill-inbox: the two commands of the README are `make demo` and `make test`.
GO     ?= go
BROKER ?= postgres
MODE   ?= immediate

.PHONY: demo test test-short bench services vet

## demo: the main job: real messages through a real broker, real duplicates, real crashes,
## verified balances (BROKER=postgres|amqp|kafka|sqs|nats|redis; kafka and sqs run in-process;
## MODE=immediate|store-then-process, the inbox mode).
demo:
	$(GO) run ./examples/billing -broker=$(BROKER) -mode=$(MODE)

## test: vet, then every test against the real PostgreSQL, RabbitMQ, NATS and Redis, with the race
## detector, including the two that restart the machine's PostgreSQL cluster and RabbitMQ node
## (INBOX_TEST_RESTART_SERVICES=1; a plain `go test ./...` skips them). Packages run one at a
## time (-p 1): a restart must not overlap with another package's tests.
test: vet
	INBOX_TEST_RESTART_SERVICES=1 $(GO) test -race -count=1 -p 1 -timeout 20m ./...
	# The RabbitMQ restart test, built without -race: the reconnect of watermill-amqp v3.0.2
	# has a data race of its own (see tests/rabbitrestart_test.go).
	INBOX_TEST_RESTART_SERVICES=1 $(GO) test -count=1 -timeout 5m -run '^TestRabbitMQRestartMidStream$$' ./tests/

## test-short: the tier that needs no service (unit tests, configuration, in-process Kafka and SQS).
test-short:
	$(GO) test -short -count=1 ./...

vet:
	$(GO) vet ./...

## bench: the inbox against a bare transaction, at 1, 8 and 32 concurrent deliveries.
bench:
	$(GO) test ./middleware/inbox -run '^$$' -bench InboxVsBareTx -benchtime 3000x -count 3

## services: start PostgreSQL, RabbitMQ, Redis and NATS (JetStream) when they are down.
services:
	bash .ci/services
