package kafka_test

// Helpers shared by the Kafka tests: the bank schema the handler updates, the consumer
// (Watermill router + the inbox middleware + pgstore + this package's subscriber), the
// publisher, and the child consumer process that crash tests kill with SIGKILL. The kfake
// cluster always runs in the test process; a child reaches it through the addresses passed in
// its environment.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/adapters/kafka"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// bankConsumerName is the inbox consumer name of every consumer in these tests.
const bankConsumerName = "bank"

// partitionKeyMetadata is the metadata field the test publisher's PartitionKey reads.
const partitionKeyMetadata = "pkey"

// bankSchemaSQL creates the observation tables (testenv's CreateAccounts the business table). applied is written in
// the inbox transaction (so it holds exactly the committed effects and who applied them);
// deliveries is written on an autocommit connection before the inbox runs, so it records every
// delivery, including redeliveries skipped as duplicates and those of killed processes.
const bankSchemaSQL = `
CREATE TABLE applied (id bigserial PRIMARY KEY, message_id text NOT NULL, consumer text NOT NULL);
CREATE TABLE deliveries (id bigserial PRIMARY KEY, message_id text NOT NULL, kafka_partition int NOT NULL,
	kafka_offset bigint NOT NULL, consumer text NOT NULL, pid int NOT NULL);
`

// setupBank creates the bank tables with accounts 1..accounts at balance 0 in schema, migrates
// the inbox table into it and returns the store.
func setupBank(t testing.TB, schema *testenv.Schema, accounts int) *pgstore.Store {
	t.Helper()
	schema.CreateAccounts(t, accounts)
	schema.Exec(t, bankSchemaSQL)
	return schema.Store(t)
}

// payment is the message payload: add Amount to account Account.
type payment struct {
	Account int   `json:"account"`
	Amount  int64 `json:"amount"`
}

// paymentMsg returns a message with the producer-assigned id, a payment payload and, when
// key is not empty, the Kafka record key the test publisher uses.
func paymentMsg(t testing.TB, id string, account int, amount int64, key string) *message.Message {
	t.Helper()
	b, err := json.Marshal(payment{Account: account, Amount: amount})
	if err != nil {
		t.Fatal(err)
	}
	m := message.NewMessage(id, b)
	if key != "" {
		m.Metadata.Set(partitionKeyMetadata, key)
	}
	return m
}

// testKafkaConfig is the adapter configuration of every test consumer: short group timeouts
// (the kfake cluster allows them, see kafkatest.MinSessionTimeout) so that rebalances and the
// eviction of a killed member take about a second, not Kafka's default ten. FetchMaxWait is
// short too: heartbeats queue behind idle fetches on the coordinator's connection, and with
// sarama's 500 ms fetch wait a live consumer was sometimes evicted (see Config.FetchMaxWait).
func testKafkaConfig(brokers []string, group string) kafka.Config {
	return kafka.Config{
		Brokers:           brokers,
		ConsumerGroup:     group,
		SessionTimeout:    time.Second,
		HeartbeatInterval: 100 * time.Millisecond,
		RebalanceTimeout:  10 * time.Second,
		FetchMaxWait:      50 * time.Millisecond,
		CommitInterval:    200 * time.Millisecond,
		NackResendSleep:   50 * time.Millisecond,
		PartitionKey: func(_ string, msg *message.Message) (string, error) {
			return msg.Metadata.Get(partitionKeyMetadata), nil
		},
	}
}

// newPublisher returns a publisher on brokers that keys records by the "pkey" metadata field
// and closes it when t ends.
func newPublisher(t testing.TB, brokers []string) message.Publisher {
	t.Helper()
	pub, err := kafka.NewPublisher(testKafkaConfig(brokers, ""), watermill.NopLogger{})
	if err != nil {
		t.Fatalf("kafka publisher: %v", err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// querier is satisfied by *pgxpool.Pool and *pgx.Conn.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// queryInt runs a query returning one integer and fails t on error.
func queryInt(t testing.TB, q querier, sql string, args ...any) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var n int64
	if err := q.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// waitUntil polls cond every 25 ms until it reports true, and fails t after timeout with the
// last status cond returned.
func waitUntil(t testing.TB, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, status := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s; last status: %s", timeout, what, status)
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// balances returns every account's balance by id.
func balances(t testing.TB, pool *pgxpool.Pool) map[int]int64 {
	t.Helper()
	rows, err := pool.Query(context.Background(), "SELECT id, balance FROM accounts")
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]int64{}
	for rows.Next() {
		var id int
		var b int64
		if err := rows.Scan(&id, &b); err != nil {
			t.Fatal(err)
		}
		out[id] = b
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// ---------------------------------------------------------------------------------------------
// The consumer: router + inbox + pgstore + the Kafka subscriber.

// consumerConfig configures startConsumer.
type consumerConfig struct {
	// Pool runs the inbox transactions and the autocommit observation writes; give it at least
	// two connections per partition the consumer may own.
	Pool    *pgxpool.Pool
	Schema  string
	Brokers []string
	Topic   string
	Group   string
	// Name identifies this consumer in the applied and deliveries tables.
	Name string
	// CommitEveryAck commits offsets synchronously after every ack instead of every 200 ms.
	CommitEveryAck bool
	// HandlerDelay is slept inside the handler (inside the inbox transaction).
	HandlerDelay time.Duration
	Logger       watermill.LoggerAdapter
	// Outer are router-level middlewares added after the delivery recorder and before the
	// inbox, so they run outside it: after the inbox committed and before the router acks.
	Outer []message.HandlerMiddleware
	// AfterUpdate, when set, runs inside the handler after its UPDATE; its error is returned.
	AfterUpdate func(msg *message.Message) error
}

// consumer is a running router.
type consumer struct {
	*testenv.RunningRouter
	Inbox *inbox.Inbox
}

// bankHandler applies a payment on the inbox transaction and records who applied it.
func bankHandler(cfg consumerConfig) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		var p payment
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return inbox.Permanent(fmt.Errorf("decode payment: %w", err))
		}
		tx, ok := pgstore.TxFromContext(ctx)
		if !ok {
			return errors.New("no inbox transaction in the message context")
		}
		tag, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + $1 WHERE id = $2", p.Amount, p.Account)
		if err != nil {
			return fmt.Errorf("update balance: %w", err)
		}
		if tag.RowsAffected() != 1 {
			return inbox.Permanent(fmt.Errorf("account %d not found", p.Account))
		}
		if _, err := tx.Exec(ctx, "INSERT INTO applied (message_id, consumer) VALUES ($1, $2)", msg.UUID, cfg.Name); err != nil {
			return fmt.Errorf("record applied: %w", err)
		}
		if cfg.HandlerDelay > 0 {
			time.Sleep(cfg.HandlerDelay)
		}
		if cfg.AfterUpdate != nil {
			return cfg.AfterUpdate(msg)
		}
		return nil
	}
}

// startConsumer builds and runs the consumer and closes it when t ends. Middleware order,
// outermost first: delivery recorder, cfg.Outer, the inbox, the bank handler. The router is
// running when it returns; the consumer group joins asynchronously.
func startConsumer(t testing.TB, cfg consumerConfig) *consumer {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = newTestLogger(t)
	}
	store, err := pgstore.New(cfg.Pool, pgstore.Config{Schema: cfg.Schema})
	if err != nil {
		t.Fatalf("pgstore.New: %v", err)
	}
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: bankConsumerName}, cfg.Logger)
	if err != nil {
		t.Fatalf("inbox.New: %v", err)
	}
	kcfg := testKafkaConfig(cfg.Brokers, cfg.Group)
	if cfg.CommitEveryAck {
		kcfg.CommitInterval = kafka.CommitEveryAck
	}
	sub, err := kafka.NewSubscriber(kcfg, cfg.Logger)
	if err != nil {
		t.Fatalf("kafka subscriber: %v", err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, cfg.Logger)
	if err != nil {
		t.Fatalf("router: %v", err)
	}
	pid := os.Getpid()
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			p, okP := wmkafka.MessagePartitionFromCtx(msg.Context())
			o, okO := wmkafka.MessagePartitionOffsetFromCtx(msg.Context())
			if !okP || !okO {
				return nil, errors.New("no Kafka partition/offset in the message context")
			}
			if _, err := cfg.Pool.Exec(msg.Context(), "INSERT INTO deliveries (message_id, kafka_partition, kafka_offset, consumer, pid) VALUES ($1, $2, $3, $4, $5)",
				msg.UUID, p, o, cfg.Name, pid); err != nil {
				return nil, fmt.Errorf("record delivery: %w", err)
			}
			return h(msg)
		}
	})
	router.AddMiddleware(cfg.Outer...)
	h := router.AddConsumerHandler("bank", cfg.Topic, sub, bankHandler(cfg))
	h.AddMiddleware(ib.Middleware) // handler-level, added after the router-level ones: innermost

	return &consumer{RunningRouter: testenv.RunRouter(t, router), Inbox: ib}
}

// ---------------------------------------------------------------------------------------------
// The child consumer process.

// Environment of the child consumer (TestHelperKafkaConsumer).
const (
	envChild            = "INBOX_KAFKA_CHILD"
	envChildDSN         = "INBOX_KAFKA_DSN"
	envChildSchema      = "INBOX_KAFKA_SCHEMA"
	envChildBrokers     = "INBOX_KAFKA_BROKERS" // comma-separated host:port of the parent's kfake
	envChildTopic       = "INBOX_KAFKA_TOPIC"
	envChildGroup       = "INBOX_KAFKA_GROUP"
	envChildName        = "INBOX_KAFKA_NAME"
	envChildDelay       = "INBOX_KAFKA_HANDLER_DELAY"
	envChildEveryAck    = "INBOX_KAFKA_COMMIT_EVERY_ACK"
	envCrashAfterCommit = "INBOX_KAFKA_CRASH_AFTER_COMMIT"
)

// TestHelperKafkaConsumer is not a test: it is the consumer process that crash tests start
// (the test binary re-executed with INBOX_KAFKA_CHILD=1) and kill. Without INBOX_KAFKA_CHILD
// it returns at once. It consumes until SIGTERM, then prints
// "STATS processed=N duplicates=N failed=N" and exits 0. With
// INBOX_KAFKA_CRASH_AFTER_COMMIT=<id> an outer router middleware SIGKILLs the process once the
// inbox committed message <id>, before the router acks (so before watermill-kafka marks and
// commits its offset).
func TestHelperKafkaConsumer(t *testing.T) {
	if os.Getenv(envChild) != "1" {
		return
	}
	delay, err := time.ParseDuration(os.Getenv(envChildDelay))
	if err != nil {
		t.Fatalf("%s: %v", envChildDelay, err)
	}
	everyAck, _ := strconv.ParseBool(os.Getenv(envChildEveryAck))
	cfg := consumerConfig{
		Pool:           testenv.NewPool(t, os.Getenv(envChildDSN), 10),
		Schema:         os.Getenv(envChildSchema),
		Brokers:        strings.Split(os.Getenv(envChildBrokers), ","),
		Topic:          os.Getenv(envChildTopic),
		Group:          os.Getenv(envChildGroup),
		Name:           os.Getenv(envChildName),
		CommitEveryAck: everyAck,
		HandlerDelay:   delay,
		Logger:         errorLogger{watermill.NewStdLoggerWithOut(os.Stderr, false, false)},
	}
	if id := os.Getenv(envCrashAfterCommit); id != "" {
		cfg.Outer = append(cfg.Outer, func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				if err == nil && msg.UUID == id {
					fmt.Printf("CRASH after-commit %s\n", id) // os.Stdout is unbuffered
					_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
					select {} // never reached: no ack, no deferred function runs
				}
				return out, err
			}
		})
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	c := startConsumer(t, cfg)
	fmt.Printf("READY %d\n", os.Getpid())

	// Stop on SIGTERM, or when the parent is gone or the child ran too long.
	testenv.WaitChildStop(t, ctx, "child consumer")
	if err := c.Close(); err != nil {
		t.Errorf("close consumer: %v", err)
	}
	st := c.Inbox.Stats()
	fmt.Printf("STATS processed=%d duplicates=%d failed=%d\n", st.Processed, st.Duplicates, st.Failed)
}

// testLogger logs watermill errors (sarama's commit and group errors among them) on t, so a
// failing test shows them; it goes quiet once t's cleanups ran.
type testLogger struct {
	t      testing.TB
	done   *atomic.Bool
	fields watermill.LogFields
}

// newTestLogger returns a testLogger for t. Call it before starting the consumer, so that its
// cleanup (which silences it) runs after the consumer's.
func newTestLogger(t testing.TB) testLogger {
	l := testLogger{t: t, done: &atomic.Bool{}}
	t.Cleanup(func() { l.done.Store(true) })
	return l
}

func (l testLogger) Error(msg string, err error, f watermill.LogFields) {
	if !l.done.Load() {
		l.t.Logf("watermill error: %s: %v %v %v", msg, err, l.fields, f)
	}
}
func (l testLogger) Info(string, watermill.LogFields)  {}
func (l testLogger) Debug(string, watermill.LogFields) {}
func (l testLogger) Trace(string, watermill.LogFields) {}
func (l testLogger) With(f watermill.LogFields) watermill.LoggerAdapter {
	return testLogger{t: l.t, done: l.done, fields: l.fields.Add(f)}
}

// errorLogger passes only errors to the wrapped logger, to keep child output short.
type errorLogger struct{ watermill.LoggerAdapter }

func (l errorLogger) Info(string, watermill.LogFields)  {}
func (l errorLogger) Debug(string, watermill.LogFields) {}
func (l errorLogger) Trace(string, watermill.LogFields) {}
func (l errorLogger) With(f watermill.LogFields) watermill.LoggerAdapter {
	return errorLogger{l.LoggerAdapter.With(f)}
}

// childSpec says what a child consumer consumes.
type childSpec struct {
	schema       *testenv.Schema
	brokers      []string
	topic, group string
	name         string
	handlerDelay time.Duration
	everyAck     bool
	env          []string // extra "KEY=value" entries
}

// childProc is a running child consumer.
type childProc struct{ *testenv.Child }

// startChild starts the test binary as a child consumer and waits for its READY line. The
// child is killed (by its pid) when t ends if it still runs.
func startChild(t testing.TB, s childSpec) *childProc {
	t.Helper()
	env := append([]string{
		envChild + "=1",
		envChildDSN + "=" + s.schema.URL,
		envChildSchema + "=" + s.schema.Name,
		envChildBrokers + "=" + strings.Join(s.brokers, ","),
		envChildTopic + "=" + s.topic,
		envChildGroup + "=" + s.group,
		envChildName + "=" + s.name,
		envChildDelay + "=" + s.handlerDelay.String(),
		envChildEveryAck + "=" + strconv.FormatBool(s.everyAck),
	}, s.env...)
	c := &childProc{testenv.StartChild(t, "TestHelperKafkaConsumer", env)}
	c.WaitLine(t, "READY ", 30*time.Second)
	return c
}

// kill SIGKILLs the child (by its pid) and waits until it is gone.
func (c *childProc) kill(t testing.TB) {
	t.Helper()
	if err := c.Kill(); err != nil {
		t.Fatalf("SIGKILL child %d: %v", c.Pid(), err)
	}
	if err := c.WaitExit(t, 10*time.Second); !testenv.KilledBySIGKILL(err) {
		t.Fatalf("child %d: want death by SIGKILL, got %v", c.Pid(), err)
	}
}

// stop sends SIGTERM, waits for a clean exit and returns the child's inbox stats.
func (c *childProc) stop(t testing.TB) inbox.Stats {
	t.Helper()
	line := c.Stop(t, "STATS ")
	var st inbox.Stats
	if _, err := fmt.Sscanf(line, "STATS processed=%d duplicates=%d failed=%d", &st.Processed, &st.Duplicates, &st.Failed); err != nil {
		t.Fatalf("parse %q: %v", line, err)
	}
	return st
}
