//go:build unix

// Command billing is the watermill-inbox demo: an account-balance consumer that is killed on
// purpose, three times, while payments are in flight, and still applies every payment exactly
// once, dead-letters the payments it can never apply after exactly -max-attempts handler runs,
// and issues exactly one receipt per payment through the transactional outbox.
//
//	go run . [-broker=postgres|amqp|kafka|sqs|nats|redis] [-db=pgx|pgsql|mysql] [-mode=immediate|store-then-process] [-shards=3] [-messages=2000] [-accounts=50] [-dup-ratio=0.2] [-poison=3] [-max-attempts=3]
//
// The process you start is the orchestrator. It creates a fresh PostgreSQL schema, migrates the
// inbox and the outbox into it, creates the accounts (one of them frozen), publishes the
// payments (and re-sends a share of them with the same message UUID), then runs the consumer as
// a child process (itself, re-executed with -role=consumer) four times:
//
//  1. the consumer SIGKILLs itself right after the inbox committed its K-th message and before
//     the router acked it (the crash the inbox pattern exists for);
//  2. the orchestrator SIGKILLs the consumer mid-stream, while one delivery has claimed its
//     message ID and waits inside its uncommitted transaction on a row lock the orchestrator
//     holds on one account (see killMidStream: the moment is made certain, not timed);
//  3. the orchestrator publishes -poison payments to the frozen account, which the handler
//     rejects on every attempt with an ordinary error; the consumer SIGKILLs itself inside the
//     handler of one of them, on its second-to-last attempt, so the inbox's durable attempt
//     count has to carry over to the next process;
//  4. the consumer runs until every unique payment is in the inbox, every poison payment is on
//     the dead-letter topic, every receipt is counted and the broker has nothing left, then is
//     stopped with SIGTERM.
//
// Every consumer also runs the outbox relay, which publishes the receipts the billing handler
// returned (stored in the inbox transaction) to the receipts topic, and a downstream consumer
// with an inbox of its own that counts them. The broker's own redelivery drives every retry.
// Finally the orchestrator checks that each balance equals the sum of that account's unique
// payments, that the inbox holds one row per unique message ID, that each poison payment is on
// the dead-letter topic once after exactly -max-attempts handler runs, and that there is one
// receipt per unique payment; it prints a summary, and exits with status 0 and a last line
// "OK", or status 1 and "FAIL: <reason>".
//
// With -mode=store-then-process the consumer stores each delivery and acks it, and workers run
// the same billing handler later; deferred.go describes that run and its checks.
//
// -db picks the database and the inbox store (storage.go): pgx (default: pgstore, the handler
// gets a pgx.Tx), pgsql (sqlstore's PostgreSQL dialect: a *sql.Tx) or mysql (sqlstore's MySQL
// dialect: balances, business tables, inbox and outbox in a fresh MariaDB or MySQL database;
// with any broker but postgres). The same crashes and checks run on each.
//
// -shards=N splits the accounts over N PostgreSQL databases, account mod N, with one consumer
// over all of them (shards.go); the same crashes run, and the balances are checked on each
// database.
//
// Environment: INBOX_DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test?sslmode=disable),
// for -db=mysql INBOX_MYSQL_DSN (default root@tcp(127.0.0.1:3306)/, go-sql-driver's form)
// and, for -broker=amqp, INBOX_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/), for
// -broker=nats INBOX_NATS_URL (default nats://127.0.0.1:4222), for -broker=redis INBOX_REDIS_URL
// (default redis://127.0.0.1:6379). For -broker=kafka and -broker=sqs the orchestrator starts an
// in-process kfake cluster or goaws and passes its address to the consumers (inspect.go).
//
// consumer.go is the billing service as a user writes it, on package router; crash.go is the
// demo's instrumentation of it; the other files are the end-to-end test around it.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	_ "github.com/watermill-inbox/watermill-inbox/adapters/all" // the demo takes every broker by name
	"github.com/watermill-inbox/watermill-inbox/router"
)

const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

	roleOrchestrator = "orchestrator"
	roleConsumer     = "consumer"
)

// options holds the command line of both roles.
type options struct {
	role string

	broker string
	// db is where the balances, the business tables, the inbox and the outbox live (storage.go):
	// dbPgx (default), dbPgSQL or dbMySQL.
	db            string
	messages      int
	accounts      int
	dupRatio      float64
	seed          uint64
	timeout       time.Duration
	amqpConsumers int
	poison        int
	maxAttempts   int
	verbose       bool
	metricsAddr   string
	soak          bool
	// mode is router.ModeImmediate (default) or router.ModeStoreThenProcess (deferred.go).
	mode string
	// shards is the number of databases the accounts are split over (shards.go); 0 or 1:
	// one database.
	shards int

	// Consumer role only, set by the orchestrator.
	run              int
	schema           string
	topic            string
	deadLetterTopic  string
	receiptsTopic    string
	crashAfter       int
	crashOnRejection int
	appName          string
	// crashAfterApplied: store-then-process mode, SIGKILL in the worker's handler after it
	// applied this many payments (0: never).
	crashAfterApplied int
}

func parseFlags(args []string) (options, error) {
	var o options
	fs := flag.NewFlagSet("billing", flag.ContinueOnError)
	fs.StringVar(&o.role, "role", roleOrchestrator, "orchestrator (default) or consumer (internal: the orchestrator starts the consumer)")
	fs.StringVar(&o.broker, "broker", "postgres", "message broker: postgres (watermill-sql on the same database), amqp (RabbitMQ at INBOX_AMQP_URL), kafka (an in-process kfake cluster), sqs (an in-process goaws), nats (JetStream at INBOX_NATS_URL) or redis (Redis Streams at INBOX_REDIS_URL)")
	fs.StringVar(&o.db, "db", dbPgx, "database of the balances, business tables, inbox and outbox: pgx (pgstore on PostgreSQL), pgsql (sqlstore's PostgreSQL dialect, database/sql) or mysql (sqlstore's MySQL dialect on MariaDB or MySQL at INBOX_MYSQL_DSN)")
	fs.IntVar(&o.messages, "messages", 2000, "unique payment messages to publish (at least 20)")
	fs.IntVar(&o.accounts, "accounts", 50, "number of accounts the payments are spread over")
	fs.Float64Var(&o.dupRatio, "dup-ratio", 0.2, "share of the payments re-sent with the same message UUID and payload (0 to 1)")
	fs.Uint64Var(&o.seed, "seed", 0, "random seed of the workload (0: derived from the clock; printed in the summary)")
	fs.DurationVar(&o.timeout, "timeout", 120*time.Second, "overall deadline; the run reports FAIL when it passes (on amqp the run's queues expire 10 min after it)")
	fs.IntVar(&o.amqpConsumers, "amqp-consumers", 4, "AMQP consumers (channels) per subscription in the consumer, each with prefetch 16 (amqp.Config.Consumers)")
	fs.IntVar(&o.poison, "poison", 3, "payments to the frozen account: poison messages the handler rejects on every attempt (at least 1)")
	fs.IntVar(&o.maxAttempts, "max-attempts", 3, "inbox MaxAttempts: handler runs before a message is dead-lettered (at least 3: the mid-stream kill may cost a payment two attempts)")
	fs.BoolVar(&o.verbose, "v", false, "copy the consumers' logs (stderr) to stderr as they run")
	fs.StringVar(&o.metricsAddr, "metrics-addr", "", "serve the consumer's Prometheus metrics on this address at /metrics while it runs, e.g. 127.0.0.1:9464 (each consumer in turn)")
	fs.BoolVar(&o.soak, "soak", false, "soak instead of the scripted crashes: SIGKILL the consumer every 5 to 20 s (random) until every payment is processed, sample the relay's backlog, then verify (raise -messages and -timeout, e.g. -messages=100000 -timeout=2h)")
	fs.StringVar(&o.mode, "mode", router.ModeImmediate, "inbox mode: immediate (the handler runs in the delivery) or store-then-process (the delivery is stored, workers run the handler later; see deferred.go)")
	fs.IntVar(&o.shards, "shards", 0, "split the accounts over this many PostgreSQL databases on the server of INBOX_DATABASE_URL (account mod N), one consumer over all of them (inbox.Config.Stores); 0 or 1: one database (see shards.go)")
	fs.IntVar(&o.crashAfterApplied, "crash-after-applied", 0, "consumer role, store-then-process mode: SIGKILL this process inside a worker's handler after it applied this many payments, transaction open (0: never)")
	fs.IntVar(&o.run, "run", 0, "consumer role: run number of this consumer, written to the rejection log")
	fs.StringVar(&o.schema, "schema", "", "consumer role: PostgreSQL schema of this run")
	fs.StringVar(&o.topic, "topic", "", "consumer role: topic to consume")
	fs.StringVar(&o.deadLetterTopic, "dead-letter-topic", "", "consumer role: the inbox's dead-letter topic")
	fs.StringVar(&o.receiptsTopic, "receipts-topic", "", "consumer role: topic the receipts are relayed to and counted from")
	fs.IntVar(&o.crashAfter, "crash-after", 0, "consumer role: SIGKILL this process right after the inbox committed this many messages (0: never)")
	fs.IntVar(&o.crashOnRejection, "crash-on-rejection", 0, "consumer role: SIGKILL this process in the handler, when a poison payment is rejected for the N-th time (0: never)")
	fs.StringVar(&o.appName, "app-name", "billing-demo-consumer", "consumer role: PostgreSQL application_name of the consumer's connections")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	switch {
	case o.role != roleOrchestrator && o.role != roleConsumer:
		return o, fmt.Errorf("-role=%q: want %s or %s", o.role, roleOrchestrator, roleConsumer)
	case !slices.Contains(adapters.Registered(), o.broker):
		return o, fmt.Errorf("-broker=%q: want one of %s", o.broker, strings.Join(adapters.Registered(), ", "))
	case checkDB(o) != nil:
		return o, checkDB(o)
	case checkShards(o) != nil:
		return o, checkShards(o)
	case !slices.Contains(router.Modes, o.mode):
		return o, fmt.Errorf("-mode=%q: want one of %s", o.mode, strings.Join(router.Modes, ", "))
	case o.soak && o.mode != router.ModeImmediate:
		return o, errors.New("-soak runs the immediate mode only (the store-then-process demo has its own crashes)")
	case o.messages < 20:
		return o, errors.New("-messages must be at least 20")
	case o.accounts < 1:
		return o, errors.New("-accounts must be at least 1")
	case o.dupRatio < 0 || o.dupRatio > 1:
		return o, errors.New("-dup-ratio must be between 0 and 1")
	case o.timeout <= 0:
		return o, errors.New("-timeout must be positive")
	case o.amqpConsumers < 1:
		return o, errors.New("-amqp-consumers must be at least 1")
	case o.poison < 1:
		return o, errors.New("-poison must be at least 1")
	case o.maxAttempts < 3:
		return o, errors.New("-max-attempts must be at least 3: the mid-stream kill may cost a payment two attempts (its delivery and its re-sent duplicate), and it must still be applied")
	case o.role == roleConsumer && (o.schema == "" || o.topic == "" || o.deadLetterTopic == "" || o.receiptsTopic == ""):
		return o, errors.New("-role=consumer needs -schema, -topic, -dead-letter-topic and -receipts-topic")
	}
	return o, nil
}

// checkDB refuses a -db the rest of the command line cannot run with.
func checkDB(o options) error {
	switch {
	case !slices.Contains(dbKinds, o.db):
		return fmt.Errorf("-db=%q: want one of %s", o.db, strings.Join(dbKinds, ", "))
	case o.db != dbPgx && (o.mode != router.ModeImmediate || o.soak):
		return fmt.Errorf("-db=%s runs the immediate mode's scripted crashes only (store-then-process and the soak are pgstore's)", o.db)
	case o.db == dbMySQL && o.broker == "postgres":
		return errors.New("-db=mysql needs a broker other than postgres, whose topics live in PostgreSQL: e.g. -broker=amqp")
	}
	return nil
}

func databaseURL() string {
	if v := os.Getenv("INBOX_DATABASE_URL"); v != "" {
		return v
	}
	return defaultDatabaseURL
}

func main() {
	o, err := parseFlags(os.Args[1:])
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "billing:", err)
		fmt.Println("FAIL: " + err.Error())
		os.Exit(2)
	}
	if o.role == roleConsumer {
		os.Exit(runConsumer(o))
	}
	os.Exit(runOrchestrator(o))
}
