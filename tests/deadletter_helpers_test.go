package tests

// Helpers of deadletter_crash_test.go: a consumer whose inbox dead-letters to a RabbitMQ queue,
// the child process that runs it (TestHelperDeadLetterConsumer), a run recorder that notes the
// inbox's durable attempt number, and RabbitMQ helpers to read dead letters.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// dlHandlerName is the router handler name of the dead-letter consumer: the dead letters'
// handler_poisoned.
const dlHandlerName = "bank-dl"

// dlSchemaSQL adds the run log of the dead-letter tests to the bank tables. A row is written
// per handler run on an autocommit connection, outside the inbox transaction, so runs whose
// transaction rolled back or whose process was killed stay recorded. inbox_attempt is the
// attempt number the inbox counted durably for that run (NULL without an attempt record).
const dlSchemaSQL = `
CREATE TABLE dl_runs (id bigserial PRIMARY KEY, message_id text NOT NULL, pid int NOT NULL, inbox_attempt int);
`

// setupDeadLetterBank is setupBank plus the dl_runs table.
func setupDeadLetterBank(t testing.TB, schema *testenv.Schema, accounts int) *pgstore.Store {
	t.Helper()
	store := setupBank(t, schema, accounts)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := schema.Pool.Exec(ctx, dlSchemaSQL); err != nil {
		t.Fatalf("create dl_runs: %v", err)
	}
	return store
}

// attemptsTable is the unquoted name of the inbox's attempts table in the schema (the pools
// of these tests have search_path set to the schema).
const attemptsTable = pgstore.DefaultTable + "_attempts"

// recordRun inserts a dl_runs row for msg, with the inbox's current attempt count for it, and
// returns the run's number (1 for the message's first run, across all processes).
func recordRun(pool *pgxpool.Pool, msg *message.Message) (int64, error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(msg.Context()), 5*time.Second)
	defer cancel()
	if _, err := pool.Exec(ctx, "INSERT INTO dl_runs (message_id, pid, inbox_attempt) VALUES ($1, $2, "+
		"(SELECT attempts FROM "+attemptsTable+" WHERE message_id = $1 AND consumer_name = $3))",
		msg.UUID, os.Getpid(), bankConsumerName); err != nil {
		return 0, fmt.Errorf("record run: %w", err)
	}
	var n int64
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM dl_runs WHERE message_id = $1", msg.UUID).Scan(&n); err != nil {
		return 0, fmt.Errorf("count runs: %w", err)
	}
	return n, nil
}

// errLedger is the poison handler's failure.
var errLedger = errors.New("ledger rejected the entry")

// dlConsumerConfig configures startDLConsumer: the bank consumer of helpers_test.go (its
// variant fields are set by startDLConsumer; Subscriptions is not used) with an inbox that
// dead-letters to the RabbitMQ queue DeadLetterQueue.
type dlConsumerConfig struct {
	consumerConfig
	DeadLetterQueue string
	// DeadLetterQueueArgs are the queue arguments DeadLetterQueue was declared with beyond
	// amqpConfig's (newQueueWithArgs' extra): the dead-letter publisher declares the queue
	// before its first publish and must declare it alike.
	DeadLetterQueueArgs map[string]any
	// MaxAttempts of the inbox; 0 takes the inbox default.
	MaxAttempts int
}

// startDLConsumer runs startConsumer on cfg.Queue with one bank handler, dlHandlerName,
// behind an inbox whose dead-letter publisher is the RabbitMQ adapter's (publisher confirms;
// it declares cfg.DeadLetterQueue before its first publish) to cfg.DeadLetterQueue, and a 50 ms pause before a nack (a requeued message is
// redelivered at once). The consumer is closed when t ends.
func startDLConsumer(t testing.TB, cfg dlConsumerConfig) *consumer {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	// Registered first: closed after the router closed.
	dlPub := newAMQPBroker(t, cfg.AMQPURL, cfg.DeadLetterQueueArgs, cfg.Logger).Publisher
	cc := cfg.consumerConfig
	cc.InboxConfig = inbox.Config{
		DeadLetterPublisher: dlPub,
		DeadLetterTopic:     cfg.DeadLetterQueue,
		MaxAttempts:         cfg.MaxAttempts,
	}
	cc.NackDelay = 50 * time.Millisecond
	cc.Handlers = func(router *message.Router, sub message.Subscriber) []*message.Handler {
		return []*message.Handler{router.AddConsumerHandler(dlHandlerName, cc.Queue, sub, bankHandler(cc))}
	}
	return startConsumer(t, cc)
}

// Environment of the dead-letter child consumer (TestHelperDeadLetterConsumer), beside
// envChildDSN, envChildSchema, envChildAMQP and envChildQueue.
const (
	envDLChild       = "INBOX_IT_DL_CHILD"
	envDLQueue       = "INBOX_IT_DL_QUEUE"
	envDLMaxAttempts = "INBOX_IT_DL_MAX_ATTEMPTS"
	// envDLCrashRuns lists run numbers ("1,2") on which the handler SIGKILLs its process
	// after its UPDATE, before returning.
	envDLCrashRuns = "INBOX_IT_DL_CRASH_RUNS"
	// envDLHandler is "fail" (the handler returns errLedger after its UPDATE) or "ok".
	envDLHandler = "INBOX_IT_DL_HANDLER"
)

// TestHelperDeadLetterConsumer is not a test: it is the consumer process that the dead-letter
// crash test starts (the test binary re-executed with INBOX_IT_DL_CHILD=1) and kills. Without
// INBOX_IT_DL_CHILD it returns at once. It runs startDLConsumer on the queue with delivery
// recording, and its handler records each run in dl_runs; then, per envDLCrashRuns and
// envDLHandler, it SIGKILLs the process, fails or succeeds. On SIGTERM it prints
// "STATS processed=N duplicates=N failed=N deadlettered=N dlskips=N collisions=N" and exits 0.
func TestHelperDeadLetterConsumer(t *testing.T) {
	if os.Getenv(envDLChild) != "1" {
		return
	}
	pool := testenv.NewPool(t, os.Getenv(envChildDSN), 4)
	maxAttempts, err := strconv.Atoi(os.Getenv(envDLMaxAttempts))
	if err != nil {
		t.Fatalf("%s: %v", envDLMaxAttempts, err)
	}
	var crashRuns []int64
	for _, s := range strings.Split(os.Getenv(envDLCrashRuns), ",") {
		if s == "" {
			continue
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("%s: %v", envDLCrashRuns, err)
		}
		crashRuns = append(crashRuns, n)
	}
	fail := os.Getenv(envDLHandler) == "fail"
	cfg := dlConsumerConfig{
		consumerConfig: consumerConfig{
			Pool:             pool,
			Schema:           os.Getenv(envChildSchema),
			AMQPURL:          os.Getenv(envChildAMQP),
			Queue:            os.Getenv(envChildQueue),
			Logger:           watermill.NewStdLoggerWithOut(os.Stderr, false, false),
			RecordDeliveries: true,
			AfterUpdate: func(msg *message.Message) error {
				run, err := recordRun(pool, msg)
				if err != nil {
					return err
				}
				if slices.Contains(crashRuns, run) {
					crashNow(fmt.Sprintf("in-handler-run-%d", run), msg.UUID)
				}
				if fail {
					return errLedger
				}
				return nil
			},
		},
		DeadLetterQueue: os.Getenv(envDLQueue),
		MaxAttempts:     maxAttempts,
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	c := startDLConsumer(t, cfg)
	fmt.Printf("READY %d\n", os.Getpid())

	// Stop on SIGTERM, or when the parent is gone or the child ran too long.
	testenv.WaitChildStop(t, ctx, "child consumer")
	if err := c.Close(); err != nil {
		t.Errorf("close consumer: %v", err)
	}
	st := c.Inbox.Stats()
	fmt.Printf("STATS processed=%d duplicates=%d failed=%d deadlettered=%d dlskips=%d collisions=%d\n",
		st.Processed, st.Duplicates, st.Failed, st.DeadLettered, st.DeadLetteredSkips, st.Collisions)
}

// dlChildEnv is the environment of a dead-letter child.
type dlChildEnv struct {
	DeadLetterQueue string
	MaxAttempts     int
	CrashRuns       string // e.g. "1,2"
	Handler         string // "fail" or "ok"
}

// startDLChild starts the test binary as a dead-letter child consumer (like startChild, which
// runs TestHelperConsumer) and waits for its READY line. The child is SIGKILLed when t ends if
// it still runs.
func startDLChild(t testing.TB, schema *testenv.Schema, amqpURL, queue string, env dlChildEnv) *childProc {
	t.Helper()
	c := &childProc{testenv.StartChild(t, "TestHelperDeadLetterConsumer", []string{
		envDLChild + "=1",
		envChildDSN + "=" + schema.URL,
		envChildSchema + "=" + schema.Name,
		envChildAMQP + "=" + amqpURL,
		envChildQueue + "=" + queue,
		envDLQueue + "=" + env.DeadLetterQueue,
		envDLMaxAttempts + "=" + strconv.Itoa(env.MaxAttempts),
		envDLCrashRuns + "=" + env.CrashRuns,
		envDLHandler + "=" + env.Handler,
	})}
	c.WaitLine(t, "READY ", 30*time.Second)
	return c
}

// stopDL sends SIGTERM, waits for a clean exit and returns the child's inbox stats.
func (c *childProc) stopDL(t testing.TB) inbox.Stats {
	t.Helper()
	line := c.Stop(t, "STATS ")
	var st inbox.Stats
	if _, err := fmt.Sscanf(line, "STATS processed=%d duplicates=%d failed=%d deadlettered=%d dlskips=%d collisions=%d",
		&st.Processed, &st.Duplicates, &st.Failed, &st.DeadLettered, &st.DeadLetteredSkips, &st.Collisions); err != nil {
		t.Fatalf("parse %q: %v", line, err)
	}
	return st
}

// take removes the next ready message from queue (basic.get, then ack) and returns it decoded
// by watermill-amqp's marshaler; false when the queue is empty.
func (r *rabbitAdmin) take(t testing.TB, queue string) (*message.Message, bool) {
	t.Helper()
	ch, err := r.conn.Connection().Channel()
	if err != nil {
		t.Fatalf("open channel: %v", err)
	}
	defer ch.Close()
	d, ok, err := ch.Get(queue, false)
	if err != nil {
		t.Fatalf("get from %s: %v", queue, err)
	}
	if !ok {
		return nil, false
	}
	msg, err := amqpQueueConfig(r.url).Marshaler.Unmarshal(d)
	if err != nil {
		_ = d.Nack(false, true)
		t.Fatalf("unmarshal message from %s: %v", queue, err)
	}
	if err := d.Ack(false); err != nil {
		t.Fatalf("ack message from %s: %v", queue, err)
	}
	return msg, true
}

// ready returns the number of messages ready in queue.
func (r *rabbitAdmin) ready(t testing.TB, queue string) int {
	t.Helper()
	n, _ := r.queueState(t, queue)
	return n
}

// attemptRecord is a row of the inbox's attempts table.
type attemptRecord struct {
	Exists       bool
	Attempts     int
	DeadLettered bool
	LastError    string
	Reason       string
}

func readAttempts(t testing.TB, pool *pgxpool.Pool, messageID string) attemptRecord {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var r attemptRecord
	var lastErr, reason *string
	err := pool.QueryRow(ctx, "SELECT attempts, dead_lettered_at IS NOT NULL, last_error, dead_letter_reason FROM "+attemptsTable+
		" WHERE message_id = $1 AND consumer_name = $2", messageID, bankConsumerName).Scan(&r.Attempts, &r.DeadLettered, &lastErr, &reason)
	if err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return r
		}
		t.Fatalf("read attempts of %s: %v", messageID, err)
	}
	r.Exists = true
	if lastErr != nil {
		r.LastError = *lastErr
	}
	if reason != nil {
		r.Reason = *reason
	}
	return r
}
