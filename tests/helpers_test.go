// Package tests holds the crash and real-broker integration tests of the inbox: PostgreSQL and
// RabbitMQ must be running (see internal/testenv); a missing service fails the test, and
// under go test -short every test here skips. The two tests that restart PostgreSQL or
// RabbitMQ run only with INBOX_TEST_RESTART_SERVICES=1 (make test sets it).
//
// This file holds the helpers shared by crash_test.go, redelivery_test.go and
// pgrestart_test.go: the bank schema the handler updates, the consumer (Watermill router + the
// inbox middleware + pgstore + the project's RabbitMQ adapter, adapters/amqp), the RabbitMQ
// admin connection, and the child consumer process that crash tests kill with SIGKILL.
package tests

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	adamqp "github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// bankConsumerName is the inbox consumer name of every consumer in these tests.
const bankConsumerName = "bank"

// bankSchemaSQL creates the observation tables (testenv's CreateAccounts the business table). handler_runs and
// deliveries are written on separate autocommit connections, so they record attempts whose
// inbox transaction rolled back or whose process was killed.
const bankSchemaSQL = `
CREATE TABLE handler_runs (id bigserial PRIMARY KEY, message_id text NOT NULL, pid int NOT NULL);
CREATE TABLE deliveries (id bigserial PRIMARY KEY, message_id text NOT NULL, redelivered bool NOT NULL, pid int NOT NULL);
CREATE TABLE attempts (message_id text PRIMARY KEY, n int NOT NULL);
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

// paymentMsg returns a message with the producer-assigned id and a payment payload.
func paymentMsg(t testing.TB, id string, account int, amount int64) *message.Message {
	t.Helper()
	b, err := json.Marshal(payment{Account: account, Amount: amount})
	if err != nil {
		t.Fatal(err)
	}
	return message.NewMessage(id, b)
}

// querier is satisfied by *pgxpool.Pool and *pgx.Conn.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// queryInt runs a query returning one integer (e.g. a count or a balance) and fails t on error.
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

// tryQueryInt is queryInt that returns the error instead of failing, for polling while the
// database may be restarting.
func tryQueryInt(q querier, sql string, args ...any) (int64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var n int64
	err := q.QueryRow(ctx, sql, args...).Scan(&n)
	return n, err
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

// ackGrace is how long tests wait after the last successful handler return before they stop a
// consumer: the router acks after the handler chain returns, and the subscriber sends the ack
// frame from its own goroutine, so stopping at once could nack (requeue) the last message.
const ackGrace = 200 * time.Millisecond

// ---------------------------------------------------------------------------------------------
// RabbitMQ

// amqpConfig is the configuration of the project's RabbitMQ adapter (adapters/amqp) that the
// consumers and publishers of these tests use: durable queues named after the topic,
// persistent messages, publisher confirms (Publish returns only once RabbitMQ holds the
// message), Nack requeues, and prefetch 1, as watermill-amqp's durable queue config has it: a
// consumer holds at most one unacked delivery, which the crash tests' redelivery counts rely
// on. Queues expire after ten idle minutes should a test process die before its cleanup
// deletes them; extra adds queue arguments (the adapter's publisher declares a queue before
// its first publish to it, with these arguments, so they must match the queue's).
func amqpConfig(url string, extra map[string]any) adamqp.Config {
	args := map[string]any{"x-expires": int32(10 * 60 * 1000)}
	for k, v := range extra {
		args[k] = v
	}
	return adamqp.Config{URL: url, Prefetch: 1, QueueArguments: args, DeclareGroups: []string{""}}
}

// amqpQueueConfig is amqpConfig(url, nil) as watermill-amqp configuration, for the admin's
// raw publisher and for decoding a basic.get with the adapter's marshaler.
func amqpQueueConfig(url string) amqp.Config {
	return amqpConfig(url, nil).WatermillConfig("")
}

// newAMQPBroker returns the project's RabbitMQ adapter on url with amqpConfig(url, extra),
// closed when t ends (after whatever router closed its subscriber: closing twice is harmless).
func newAMQPBroker(t testing.TB, url string, extra map[string]any, logger watermill.LoggerAdapter) *adapters.Broker {
	t.Helper()
	b, err := adamqp.New(amqpConfig(url, extra), logger)
	if err != nil {
		t.Fatalf("amqp adapter: %v", err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

// rabbitAdmin declares, inspects and deletes queues and publishes to them. Its publisher is
// watermill-amqp's own, which does not declare queues: it publishes to queues declared with
// any arguments (a length-limited dead-letter queue) without a mismatching declare.
type rabbitAdmin struct {
	url  string
	conn *amqp.ConnectionWrapper
	pub  *amqp.Publisher
}

func newRabbitAdmin(t testing.TB) *rabbitAdmin {
	t.Helper()
	url := testenv.RequireAMQP(t)
	conn, err := amqp.NewConnection(amqp.ConnectionConfig{AmqpURI: url}, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("connect to RabbitMQ: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	pub, err := amqp.NewPublisher(amqpQueueConfig(url), watermill.NopLogger{})
	if err != nil {
		t.Fatalf("amqp publisher: %v", err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return &rabbitAdmin{url: url, conn: conn, pub: pub}
}

var nonName = regexp.MustCompile(`[^A-Za-z0-9]+`)

// newQueue declares a durable queue with a name unique to this test run and deletes it when t
// ends.
func (r *rabbitAdmin) newQueue(t testing.TB) string {
	t.Helper()
	return r.newQueueWithArgs(t, nil)
}

// newQueueWithArgs declares a durable queue with a name unique to this test run, with
// amqpQueueConfig's arguments plus extra (e.g. a length limit), and deletes it when t ends.
// The publishers of these tests use RabbitMQ's default exchange and do not declare queues, so
// the arguments need not match amqpQueueConfig's.
func (r *rabbitAdmin) newQueueWithArgs(t testing.TB, extra map[string]any) string {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "inbox_it_" + strings.ToLower(nonName.ReplaceAllString(t.Name(), "_")) + "_" + hex.EncodeToString(b[:])
	args := map[string]any{}
	for k, v := range amqpQueueConfig(r.url).Queue.Arguments {
		args[k] = v
	}
	for k, v := range extra {
		args[k] = v
	}
	ch, err := r.conn.Connection().Channel()
	if err != nil {
		t.Fatalf("open channel: %v", err)
	}
	defer ch.Close()
	// The adapter's topology for the default consumer group: the queue, named after the
	// topic, bound to the topic's fanout exchange (adapters/amqp).
	cfg := amqpQueueConfig(r.url)
	cfg.Queue.Arguments = args
	if err := cfg.TopologyBuilder.BuildTopology(ch, amqp.BuildTopologyParams{QueueName: name, ExchangeName: name}, cfg, watermill.NopLogger{}); err != nil {
		t.Fatalf("declare queue %s: %v", name, err)
	}
	t.Cleanup(func() {
		ch, err := r.conn.Connection().Channel()
		if err != nil {
			t.Errorf("delete queue %s: %v", name, err)
			return
		}
		defer ch.Close()
		if _, err := ch.QueueDelete(name, false, false, false); err != nil {
			t.Errorf("delete queue %s: %v", name, err)
		}
		_ = ch.ExchangeDelete(name, false, false)
	})
	return name
}

// queueState returns the number of messages ready for delivery (not counting delivered,
// unacked ones) and the number of consumers of queue.
func (r *rabbitAdmin) queueState(t testing.TB, queue string) (ready, consumers int) {
	t.Helper()
	ch, err := r.conn.Connection().Channel()
	if err != nil {
		t.Fatalf("open channel: %v", err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		t.Fatalf("inspect queue %s: %v", queue, err)
	}
	return q.Messages, q.Consumers
}

// publish sends msgs to queue and returns once RabbitMQ confirmed each one.
func (r *rabbitAdmin) publish(t testing.TB, queue string, msgs ...*message.Message) {
	t.Helper()
	if err := r.pub.Publish(queue, msgs...); err != nil {
		t.Fatalf("publish to %s: %v", queue, err)
	}
}

// ---------------------------------------------------------------------------------------------
// The consumer: router + inbox + pgstore + the project's RabbitMQ adapter (adapters/amqp).

// consumerConfig configures startConsumer.
type consumerConfig struct {
	// Pool runs the inbox transactions and the autocommit observation writes; give it at least
	// two connections per subscription.
	Pool    *pgxpool.Pool
	Schema  string
	AMQPURL string
	Queue   string
	// Subscriptions is the number of competing AMQP consumers (channels) on Queue, each a
	// router handler processing one delivery at a time. Default 1.
	Subscriptions int
	Logger        watermill.LoggerAdapter
	// RecordDeliveries inserts a deliveries row per delivery, before the inbox runs.
	RecordDeliveries bool
	// RecordRuns inserts a handler_runs row each time the handler (inside the inbox) runs.
	RecordRuns bool
	// Outer are router-level middlewares added after the built-in ones and before the inbox,
	// so they run outside it: after the inbox committed and before the router acks.
	Outer []message.HandlerMiddleware
	// AfterUpdate, when set, runs inside the handler after its UPDATE; its error is returned.
	AfterUpdate func(msg *message.Message) error

	// The variants of startDLConsumer and obStartProducer:

	// InboxConfig is the inbox configuration; startConsumer sets its Store and ConsumerName
	// (bankConsumerName).
	InboxConfig inbox.Config
	// NackDelay is the pause before a failed delivery is nacked. Default 25 ms.
	NackDelay time.Duration
	// Handlers adds the router handlers consuming sub, to each of which startConsumer adds the
	// inbox middleware. Default: Subscriptions bank handlers named "bank-<i>".
	Handlers func(router *message.Router, sub message.Subscriber) []*message.Handler
}

// consumer is a running router.
type consumer struct {
	*testenv.RunningRouter
	Inbox *inbox.Inbox
	// Succeeded counts handler-chain returns without error, i.e. deliveries the router acks.
	Succeeded atomic.Int64
}

// nackDelay pauses before a failed delivery is nacked, so a requeued message does not spin
// while PostgreSQL is unavailable (RabbitMQ redelivers a requeued message at once).
func nackDelay(d time.Duration) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err != nil {
				time.Sleep(d)
			}
			return out, err
		}
	}
}

// bankHandler applies a payment on the inbox transaction.
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
		if cfg.RecordRuns {
			if _, err := cfg.Pool.Exec(ctx, "INSERT INTO handler_runs (message_id, pid) VALUES ($1, $2)", msg.UUID, os.Getpid()); err != nil {
				return fmt.Errorf("record handler run: %w", err)
			}
		}
		tag, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + $1 WHERE id = $2", p.Amount, p.Account)
		if err != nil {
			return fmt.Errorf("update balance: %w", err)
		}
		if tag.RowsAffected() != 1 {
			return inbox.Permanent(fmt.Errorf("account %d not found", p.Account))
		}
		if cfg.AfterUpdate != nil {
			return cfg.AfterUpdate(msg)
		}
		return nil
	}
}

// startConsumer builds and runs the consumer, waits until it subscribed, and closes it when t
// ends. Middleware order, outermost first: success counter, nackDelay, delivery recorder,
// cfg.Outer, the inbox, the handler (by default the bank handler).
func startConsumer(t testing.TB, cfg consumerConfig) *consumer {
	t.Helper()
	if cfg.Subscriptions == 0 {
		cfg.Subscriptions = 1
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	if cfg.NackDelay == 0 {
		cfg.NackDelay = 25 * time.Millisecond
	}
	if cfg.Handlers == nil {
		cfg.Handlers = func(router *message.Router, sub message.Subscriber) []*message.Handler {
			hs := make([]*message.Handler, cfg.Subscriptions)
			for i := range hs {
				hs[i] = router.AddConsumerHandler(fmt.Sprintf("bank-%d", i), cfg.Queue, sub, bankHandler(cfg))
			}
			return hs
		}
	}
	store, err := pgstore.New(cfg.Pool, pgstore.Config{Schema: cfg.Schema})
	if err != nil {
		t.Fatalf("pgstore.New: %v", err)
	}
	icfg := cfg.InboxConfig
	icfg.Store, icfg.ConsumerName = store, bankConsumerName
	ib, err := inbox.New(icfg, cfg.Logger)
	if err != nil {
		t.Fatalf("inbox.New: %v", err)
	}
	sub := newAMQPBroker(t, cfg.AMQPURL, nil, cfg.Logger).Subscriber
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, cfg.Logger)
	if err != nil {
		t.Fatalf("router: %v", err)
	}
	c := &consumer{Inbox: ib}

	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				c.Succeeded.Add(1)
			}
			return out, err
		}
	}, nackDelay(cfg.NackDelay))
	if cfg.RecordDeliveries {
		router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				if _, err := cfg.Pool.Exec(msg.Context(), "INSERT INTO deliveries (message_id, redelivered, pid) VALUES ($1, $2, $3)",
					msg.UUID, amqp.IsMessageRedelivered(msg), os.Getpid()); err != nil {
					return nil, fmt.Errorf("record delivery: %w", err)
				}
				return h(msg)
			}
		})
	}
	router.AddMiddleware(cfg.Outer...)
	for _, h := range cfg.Handlers(router, sub) {
		h.AddMiddleware(ib.Middleware) // handler-level, added after the router-level ones: innermost
	}
	c.RunningRouter = testenv.RunRouter(t, router)
	return c
}

// countingLogger counts the errors logged per inbox step (claim, handler, commit, other) and
// keeps the first few, without printing.
type countingLogger struct {
	mu     sync.Mutex
	errors int
	steps  map[string]int
	first  []string
}

func (l *countingLogger) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errors++
	if l.steps == nil {
		l.steps = map[string]int{}
	}
	step := "other"
	for _, s := range []string{"inbox: claim:", "inbox: commit:", "update balance:", "record "} {
		if err != nil && strings.Contains(err.Error(), s) {
			step = strings.TrimSuffix(s, ":")
			break
		}
	}
	l.steps[step]++
	if len(l.first) < 3 {
		l.first = append(l.first, fmt.Sprintf("%s: %v", msg, err))
	}
}
func (l *countingLogger) Info(string, watermill.LogFields)                 {}
func (l *countingLogger) Debug(string, watermill.LogFields)                {}
func (l *countingLogger) Trace(string, watermill.LogFields)                {}
func (l *countingLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *countingLogger) summary() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return fmt.Sprintf("%d errors logged, by step %v, first: %q", l.errors, l.steps, l.first)
}

// ---------------------------------------------------------------------------------------------
// The child consumer process.

// Environment of the child consumer (TestHelperConsumer).
const (
	envChild             = "INBOX_IT_CHILD"
	envChildDSN          = "INBOX_IT_DSN"
	envChildSchema       = "INBOX_IT_SCHEMA"
	envChildAMQP         = "INBOX_IT_AMQP"
	envChildQueue        = "INBOX_IT_QUEUE"
	envCrashAfterCommit  = "INBOX_IT_CRASH_AFTER_COMMIT"
	envCrashBeforeCommit = "INBOX_IT_CRASH_BEFORE_COMMIT"
)

// crashNow prints a CRASH line and SIGKILLs the current process: no deferred function, no
// router ack, no transaction cleanup runs.
func crashNow(where, id string) {
	fmt.Printf("CRASH %s %s\n", where, id) // os.Stdout is unbuffered
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // never reached
}

// TestHelperConsumer is not a test: it is the consumer process that crash tests start (the
// test binary re-executed with INBOX_IT_CHILD=1) and kill. Without INBOX_IT_CHILD it returns
// at once. It consumes the queue until SIGTERM, then prints
// "STATS processed=N duplicates=N failed=N" and exits 0. With INBOX_IT_CRASH_AFTER_COMMIT=<id>
// an outer router middleware SIGKILLs the process once the inbox committed message <id>,
// before the router acks; with INBOX_IT_CRASH_BEFORE_COMMIT=<id> the handler SIGKILLs it after
// its UPDATE, before the inbox commits.
func TestHelperConsumer(t *testing.T) {
	if os.Getenv(envChild) != "1" {
		return
	}
	pool := testenv.NewPool(t, os.Getenv(envChildDSN), 4)
	cfg := consumerConfig{
		Pool:             pool,
		Schema:           os.Getenv(envChildSchema),
		AMQPURL:          os.Getenv(envChildAMQP),
		Queue:            os.Getenv(envChildQueue),
		Logger:           watermill.NewStdLoggerWithOut(os.Stderr, false, false),
		RecordDeliveries: true,
		RecordRuns:       true,
	}
	if id := os.Getenv(envCrashAfterCommit); id != "" {
		cfg.Outer = append(cfg.Outer, func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				if err == nil && msg.UUID == id {
					crashNow("after-commit", id)
				}
				return out, err
			}
		})
	}
	if id := os.Getenv(envCrashBeforeCommit); id != "" {
		cfg.AfterUpdate = func(msg *message.Message) error {
			if msg.UUID == id {
				crashNow("before-commit", id)
			}
			return nil
		}
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

// childProc is a running child consumer.
type childProc struct{ *testenv.Child }

// startChild starts the test binary as a child consumer of queue on schema, with extra
// environment entries ("KEY=value"), and waits for its READY line. The child is killed when t
// ends if it still runs.
func startChild(t testing.TB, schema *testenv.Schema, amqpURL, queue string, extraEnv ...string) *childProc {
	t.Helper()
	env := append([]string{
		envChild + "=1",
		envChildDSN + "=" + schema.URL,
		envChildSchema + "=" + schema.Name,
		envChildAMQP + "=" + amqpURL,
		envChildQueue + "=" + queue,
	}, extraEnv...)
	c := &childProc{testenv.StartChild(t, "TestHelperConsumer", env)}
	c.WaitLine(t, "READY ", 30*time.Second)
	return c
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
