package tests

// Helpers of outbox_crash_test.go: the producing consumer (inbox + outbox, no relay), the
// relay, both runnable as child processes that SIGKILL themselves at an injected point, and
// the downstream consumer (another inbox) that records what reaches it.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// obDownstreamConsumerName is the inbox consumer name of the downstream consumer.
const obDownstreamConsumerName = "downstream"

// obDownstreamSchemaSQL is the downstream consumer's business table: one row per message it
// processed, without a unique key, so a message processed twice would show as two rows.
const obDownstreamSchemaSQL = `
CREATE TABLE downstream_received (
	id bigserial PRIMARY KEY,
	message_id text NOT NULL,
	source_message text NOT NULL,
	name text NOT NULL,
	seq text NOT NULL,
	payload text NOT NULL
);`

// Environment of the outbox child process (TestHelperOutboxChild).
const (
	envOutboxChild       = "OUTBOX_IT_CHILD" // "consumer" or "relay"
	envOutboxDSN         = "OUTBOX_IT_DSN"
	envOutboxSchema      = "OUTBOX_IT_SCHEMA"
	envOutboxAMQP        = "OUTBOX_IT_AMQP"
	envOutboxQueue       = "OUTBOX_IT_QUEUE"      // the consumer's input queue
	envOutboxDownstream  = "OUTBOX_IT_DOWNSTREAM" // the consumer's publish topic (a queue)
	envOutboxCrashCommit = "OUTBOX_IT_CRASH_AFTER_COMMITS"
	envOutboxCrashRelay  = "OUTBOX_IT_CRASH_AFTER_FORWARDS"
)

// obProducedFor returns the messages the producing handler returns for the payment in: one for
// account 1, two for account 2. Their IDs are derived from the input's (UUIDv5), so a test
// knows them in advance, and a handler that runs again would produce the same IDs.
func obProducedFor(in *message.Message, p payment) []*message.Message {
	n := 1
	if p.Account == 2 {
		n = 2
	}
	out := make([]*message.Message, n)
	for i := range n {
		seq := strconv.Itoa(i + 1)
		id := uuid.NewSHA1(uuid.NameSpaceURL, []byte("outbox-it:"+in.UUID+"#"+seq)).String()
		name := "PaymentApplied"
		if i == 1 {
			name = "ReceiptRequested"
		}
		b, _ := json.Marshal(map[string]any{"source": in.UUID, "account": p.Account, "amount": p.Amount, "seq": i + 1})
		m := message.NewMessage(id, b)
		m.Metadata.Set("name", name)
		m.Metadata.Set("source_message", in.UUID)
		m.Metadata.Set("seq", seq)
		out[i] = m
	}
	return out
}

// obRefusingPublisher is the router's publisher for the producing handler: produced messages go
// to the outbox, so the router must never publish.
type obRefusingPublisher struct{}

func (obRefusingPublisher) Publish(string, ...*message.Message) error {
	return errors.New("the router must not publish: produced messages go to the outbox")
}
func (obRefusingPublisher) Close() error { return nil }

// obProducerConfig configures obStartProducer.
type obProducerConfig struct {
	Pool       *pgxpool.Pool
	Schema     string
	AMQPURL    string
	Queue      string
	Downstream string
	Logger     watermill.LoggerAdapter
	// Outer are router-level middlewares outside the inbox (after commit, before ack).
	Outer []message.HandlerMiddleware
}

// obStartProducer runs the producing consumer: RabbitMQ queue -> router.AddHandler (publish
// topic Downstream) -> inbox "bank" with the outbox -> a handler that applies the payment and
// records its run on an autocommit connection. It runs no relay.
func obStartProducer(t testing.TB, cfg obProducerConfig) *consumer {
	t.Helper()
	ob, err := outbox.New(outbox.Config{}, cfg.Logger)
	if err != nil {
		t.Fatalf("outbox.New: %v", err)
	}
	return startConsumer(t, consumerConfig{
		Pool: cfg.Pool, Schema: cfg.Schema, AMQPURL: cfg.AMQPURL, Queue: cfg.Queue, Logger: cfg.Logger, Outer: cfg.Outer,
		InboxConfig: inbox.Config{Outbox: ob},
		Handlers: func(router *message.Router, sub message.Subscriber) []*message.Handler {
			return []*message.Handler{router.AddHandler("bank-producer", cfg.Queue, sub, cfg.Downstream, obRefusingPublisher{}, obProducerHandler(cfg.Pool))}
		},
	})
}

// obProducerHandler applies a payment on the inbox transaction, records its run on an
// autocommit connection and returns obProducedFor's messages.
func obProducerHandler(pool *pgxpool.Pool) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		var p payment
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return nil, inbox.Permanent(fmt.Errorf("decode payment: %w", err))
		}
		tx, ok := pgstore.TxFromContext(ctx)
		if !ok {
			return nil, errors.New("no inbox transaction in the message context")
		}
		if _, err := pool.Exec(ctx, "INSERT INTO handler_runs (message_id, pid) VALUES ($1, $2)", msg.UUID, os.Getpid()); err != nil {
			return nil, fmt.Errorf("record handler run: %w", err)
		}
		if _, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + $1 WHERE id = $2", p.Amount, p.Account); err != nil {
			return nil, fmt.Errorf("update balance: %w", err)
		}
		return obProducedFor(msg, p), nil
	}
}

// obDownstream is the downstream consumer: an inbox "downstream" that stores every message it
// processes in downstream_received, in the inbox transaction.
type obDownstream struct {
	*consumer
	Deliveries atomic.Int64 // deliveries that reached the router's handler chain
}

func obStartDownstream(t testing.TB, pool *pgxpool.Pool, schema, amqpURL, queue string) *obDownstream {
	t.Helper()
	store, err := pgstore.New(pool, pgstore.Config{Schema: schema})
	if err != nil {
		t.Fatalf("pgstore.New: %v", err)
	}
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: obDownstreamConsumerName}, nil)
	if err != nil {
		t.Fatalf("inbox.New: %v", err)
	}
	sub := newAMQPBroker(t, amqpURL, nil, watermill.NopLogger{}).Subscriber
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("router: %v", err)
	}
	d := &obDownstream{consumer: &consumer{Inbox: ib}}
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			d.Deliveries.Add(1)
			out, err := h(msg)
			if err == nil {
				d.Succeeded.Add(1)
			}
			return out, err
		}
	}, nackDelay(25*time.Millisecond), ib.Middleware)
	router.AddConsumerHandler("downstream", queue, sub, func(msg *message.Message) error {
		tx, ok := pgstore.TxFromContext(msg.Context())
		if !ok {
			return errors.New("no inbox transaction in the message context")
		}
		_, err := tx.Exec(msg.Context(), "INSERT INTO downstream_received (message_id, source_message, name, seq, payload) VALUES ($1, $2, $3, $4, $5)",
			msg.UUID, msg.Metadata.Get("source_message"), msg.Metadata.Get("name"), msg.Metadata.Get("seq"), string(msg.Payload))
		return err
	})
	d.RunningRouter = testenv.RunRouter(t, router)
	return d
}

// obRelayConfig is the relay every process of the crash test runs: to RabbitMQ, with publisher
// confirms, polling every 20 ms, in batches of watermill-sql's default size.
func obRelayConfig(pool *pgxpool.Pool, amqpPub message.Publisher, group string, mw ...message.HandlerMiddleware) outbox.RelayConfig {
	return outbox.RelayConfig{
		Pool:          pool,
		Publisher:     amqpPub,
		ConsumerGroup: group,
		PollInterval:  20 * time.Millisecond,
		Middlewares:   mw,
	}
}

// obRunningRelay is a Relay running in this process.
type obRunningRelay struct {
	*outbox.Relay
	done chan error
}

// obStartRelay runs a relay and closes it when t ends.
func obStartRelay(t testing.TB, cfg outbox.RelayConfig, logger watermill.LoggerAdapter) *obRunningRelay {
	t.Helper()
	r, err := outbox.NewRelay(cfg, logger)
	if err != nil {
		t.Fatalf("outbox.NewRelay: %v", err)
	}
	rr := &obRunningRelay{Relay: r, done: make(chan error, 1)}
	go func() { rr.done <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-rr.done:
		t.Fatalf("relay stopped before running: %v", err)
	case <-time.After(15 * time.Second):
		t.Fatal("relay did not start within 15s")
	}
	t.Cleanup(func() { _ = r.Close() })
	return rr
}

// stop closes the relay and checks that Run returned nil.
func (r *obRunningRelay) stop(t testing.TB) {
	t.Helper()
	if err := r.Close(); err != nil {
		t.Errorf("relay close: %v", err)
	}
	select {
	case err := <-r.done:
		if err != nil {
			t.Errorf("relay Run: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Error("relay Run did not return within 20s of Close")
	}
}

// obCrashAfter returns a middleware that SIGKILLs the process once n deliveries returned
// without error through it.
func obCrashAfter(n int64, where string) message.HandlerMiddleware {
	var ok atomic.Int64
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil && ok.Add(1) == n {
				crashNow(where, msg.UUID)
			}
			return out, err
		}
	}
}

// TestHelperOutboxChild is not a test: it is the process outbox crash tests start (the test
// binary re-executed with OUTBOX_IT_CHILD set) and kill. Without OUTBOX_IT_CHILD it returns at
// once.
//
//   - OUTBOX_IT_CHILD=consumer runs the producing consumer (obStartProducer, no relay); with
//     OUTBOX_IT_CRASH_AFTER_COMMITS=N an outer middleware SIGKILLs it once the inbox committed
//     N deliveries, before the router acks the Nth.
//   - OUTBOX_IT_CHILD=relay runs the relay to RabbitMQ; with OUTBOX_IT_CRASH_AFTER_FORWARDS=N a
//     relay middleware SIGKILLs it once N messages were published (confirmed by RabbitMQ),
//     before the batch's offset is committed.
//
// It prints "READY <pid>", runs until SIGTERM, then prints
// "STATS processed=N duplicates=N failed=N" (for the relay: processed = messages forwarded).
func TestHelperOutboxChild(t *testing.T) {
	role := os.Getenv(envOutboxChild)
	if role == "" {
		return
	}
	pool := testenv.NewPool(t, os.Getenv(envOutboxDSN), 4)
	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false)
	amqpURL := os.Getenv(envOutboxAMQP)
	crashN := func(env string) int64 {
		n, _ := strconv.ParseInt(os.Getenv(env), 10, 64)
		return n
	}

	var stats func() string
	var stop func() error
	switch role {
	case "consumer":
		cfg := obProducerConfig{
			Pool: pool, Schema: os.Getenv(envOutboxSchema), AMQPURL: amqpURL,
			Queue: os.Getenv(envOutboxQueue), Downstream: os.Getenv(envOutboxDownstream), Logger: logger,
		}
		if n := crashN(envOutboxCrashCommit); n > 0 {
			cfg.Outer = append(cfg.Outer, obCrashAfter(n, "after-commit"))
		}
		c := obStartProducer(t, cfg)
		stop = c.Close
		stats = func() string {
			st := c.Inbox.Stats()
			return fmt.Sprintf("STATS processed=%d duplicates=%d failed=%d", st.Processed, st.Duplicates, st.Failed)
		}
	case "relay":
		pub := newAMQPBroker(t, amqpURL, nil, logger).Publisher
		var forwarded atomic.Int64
		mw := []message.HandlerMiddleware{func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				if err == nil {
					forwarded.Add(1)
				}
				return out, err
			}
		}}
		if n := crashN(envOutboxCrashRelay); n > 0 {
			mw = append(mw, obCrashAfter(n, "after-forward"))
		}
		cfg := obRelayConfig(pool, pub, "", mw...)
		if crashN(envOutboxCrashRelay) > 0 {
			// One publish at a time: the crash after the n-th forward comes after exactly n
			// publishes were confirmed (pipelined, the last ones might still be in flight).
			cfg.MaxInFlight = 1
		}
		r := obStartRelay(t, cfg, logger)
		stop = func() error { r.stop(t); return nil }
		stats = func() string { return fmt.Sprintf("STATS processed=%d duplicates=0 failed=0", forwarded.Load()) }
	default:
		t.Fatalf("unknown %s=%q", envOutboxChild, role)
	}
	fmt.Printf("READY %d\n", os.Getpid())

	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer cancel()
	// Stop on SIGTERM, or when the parent is gone or the child ran too long.
	testenv.WaitChildStop(t, ctx, "child")
	if err := stop(); err != nil {
		t.Errorf("stop: %v", err)
	}
	fmt.Println(stats())
}

// startOutboxChild starts the test binary as an outbox child process in role ("consumer" or
// "relay") with extra environment entries, and waits for its READY line. The child is killed
// when t ends if it still runs.
func startOutboxChild(t testing.TB, role string, schema *testenv.Schema, amqpURL, queue, downstreamQueue string, extraEnv ...string) *childProc {
	t.Helper()
	env := append([]string{
		envOutboxChild + "=" + role,
		envOutboxDSN + "=" + schema.URL,
		envOutboxSchema + "=" + schema.Name,
		envOutboxAMQP + "=" + amqpURL,
		envOutboxQueue + "=" + queue,
		envOutboxDownstream + "=" + downstreamQueue,
	}, extraEnv...)
	c := &childProc{testenv.StartChild(t, "TestHelperOutboxChild", env)}
	c.WaitLine(t, "READY ", 30*time.Second)
	return c
}

// obExpectSIGKILL waits for the child to die of SIGKILL and checks its CRASH line.
func obExpectSIGKILL(t testing.TB, c *childProc, where, id string) {
	t.Helper()
	err := c.WaitExit(t, 30*time.Second)
	if !testenv.KilledBySIGKILL(err) {
		t.Fatalf("child should have died of SIGKILL, got %v", err)
	}
	line, ok := c.Find("CRASH ")
	if want := "CRASH " + where + " "; !ok || len(line) < len(want) || line[:len(want)] != want {
		t.Fatalf("child died without reaching the injected crash point %q: CRASH line %q", where, line)
	}
	if id != "" && line != "CRASH "+where+" "+id {
		t.Fatalf("CRASH line %q, want %q", line, "CRASH "+where+" "+id)
	}
}
