package adaptertest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/inboxtest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// The crash matrix of the batched mode (inbox.Config.Batch, group commit): a child consumer
// whose deliveries share transactions is SIGKILLed before a batch's claim, inside a handler of
// a batch, and between a batch's COMMIT and the acks; a restarted child finishes the work
// through the broker's own redelivery.

// Environment of the batched crash child.
const (
	envBatchChild = "ADAPTERTEST_BATCH_CHILD"
	envBatchSize  = "ADAPTERTEST_BATCH_SIZE"
	envHandlers   = "ADAPTERTEST_HANDLERS"
	envCrashPoint = "ADAPTERTEST_CRASH_POINT" // before-claim, in-handler or after-commit
)

// Crash points of RunBatchedCrashes.
const (
	crashBeforeClaim = "before-claim"
	crashInHandler   = "in-handler"
	crashAfterCommit = "after-commit"
)

// batchSchemaSQL: applied is written in the inbox transaction (the committed effects);
// batch_runs on an autocommit connection, one row per handler run with the transaction it ran
// in, so it also records runs whose batch rolled back or whose process was killed.
const batchSchemaSQL = `
CREATE TABLE applied (message_id text NOT NULL);
CREATE TABLE batch_runs (message_id text NOT NULL, txid bigint NOT NULL, pid int NOT NULL);
`

// batchAmounts are the payments of the batched crash tests, to account 5: distinct powers of
// two.
var batchAmounts = []int64{1, 2, 4, 8, 16, 32, 64, 128}

// RunBatchedCrashes runs the crash matrix in the batched mode as subtests of t, with a batch
// size of 4 and handlers router handlers on the topic in the child (give the broker at least
// 4 concurrent deliveries in all, e.g. AMQP Consumers 4 and Prefetch 1, or a Kafka topic of 4
// partitions with one handler: a batch is only as big as the subscriber's concurrency). The
// child is h.ChildTest, whose Child call runs the batched child when the matrix starts it.
func RunBatchedCrashes(t *testing.T, h Harness, handlers int) {
	if h.Timeout == 0 {
		h.Timeout = 30 * time.Second
	}
	if h.ChildTest == "" {
		h.ChildTest = "TestAdapterChild"
	}
	for _, point := range []string{crashBeforeClaim, crashInHandler, crashAfterCommit} {
		t.Run("Batched/Crash/"+point, func(t *testing.T) { batchedCrash(t, h, handlers, point) })
	}
}

func batchedCrash(t *testing.T, h Harness, handlers int, point string) {
	start := time.Now()
	f := newFixture(t, h)
	f.sch.Exec(t, batchSchemaSQL)
	var msgs []*message.Message
	for k, a := range batchAmounts {
		msgs = append(msgs, paymentMsg(fmt.Sprintf("bpay-%d", k), 5, a, false))
	}
	f.publish(msgs...)
	_ = f.broker.Close() // the parent only publishes; the children consume
	startChild := func(crash bool) *inboxtest.Child {
		env := append(append([]string{}, h.Env...),
			envChild+"=1", envBatchChild+"=1", envDB+"="+f.sch.URL, envSch+"="+f.sch.Name, envTopic+"="+f.topic, envGroup+"="+f.group,
			envBatchSize+"=4", envHandlers+"="+strconv.Itoa(handlers))
		if crash {
			env = append(env, envCrashPoint+"="+point)
		}
		return inboxtest.StartChild(t, h.ChildTest, env)
	}

	first := startChild(true)
	if err := first.WaitExit(t, h.Timeout); !inboxtest.KilledBySIGKILL(err) {
		t.Fatalf("first child ended with %v, want death by SIGKILL at the injected point", err)
	}
	// The child crashes at the first batch of two or more members (the broker may hand out
	// the backlog's first deliveries one by one, which run alone): the CRASH line names the
	// member it crashed on.
	line, _ := first.Find("CRASH ")
	var crashID string
	var members int
	if _, err := fmt.Sscanf(line, "CRASH "+point+" %s members=%d", &crashID, &members); err != nil || !slices.ContainsFunc(msgs, func(m *message.Message) bool { return m.UUID == crashID }) {
		t.Fatalf("first child died without reaching the crash point: %q", line)
	}
	if members < 2 {
		t.Fatalf("the crashed delivery's batch had %d members; the test needs a batch (concurrent deliveries)", members)
	}
	committed := f.count("SELECT count(*) FROM inbox_processed_messages WHERE message_id = $1", crashID)
	if want := b2i(point == crashAfterCommit); committed != int64(want) {
		t.Fatalf("after a crash %s the crashed message has %d inbox rows, want %d", point, committed, want)
	}
	firstPID := first.Pid()
	if point == crashInHandler {
		// The killed batch shared its transaction: none of its members committed.
		if n := f.count("SELECT count(*) FROM batch_runs r WHERE pid = $1 AND txid = (SELECT txid FROM batch_runs WHERE message_id = $2 AND pid = $1)"+
			" AND EXISTS (SELECT 1 FROM inbox_processed_messages p WHERE p.message_id = r.message_id)", firstPID, crashID); n != 0 {
			t.Fatalf("%d members of the killed batch were committed", n)
		}
	}

	second := startChild(false) // killed when t ends
	f.waitFor("every payment processed", func() bool {
		return f.count("SELECT count(*) FROM inbox_processed_messages") == int64(len(msgs))
	})
	var sum int64
	for _, a := range batchAmounts {
		sum += a
	}
	if b := f.count("SELECT balance FROM accounts WHERE id = 5"); b != sum {
		t.Fatalf("balance %d, want %d", b, sum)
	}
	if n := f.count("SELECT count(*) FROM (SELECT message_id FROM applied GROUP BY message_id HAVING count(*) = 1) s"); n != int64(len(msgs)) {
		t.Fatalf("%d messages applied exactly once, want %d (applied rows: %d)", n, len(msgs), f.count("SELECT count(*) FROM applied"))
	}
	runs := func(pid int) int64 {
		return f.count("SELECT count(*) FROM batch_runs WHERE message_id = $1 AND pid = $2", crashID, pid)
	}
	want := map[string][2]int64{
		crashBeforeClaim: {0, 1}, // never ran in the killed process
		crashInHandler:   {1, 1}, // rolled back with the process, ran again
		crashAfterCommit: {1, 0}, // committed: the redelivery is a duplicate
	}[point]
	wantFirst, wantSecond := want[0], want[1]
	if got1, got2 := runs(firstPID), runs(second.Pid()); got1 != wantFirst || got2 != wantSecond {
		t.Fatalf("handler runs of the crashed message: %d in the killed process, %d in the restarted one; want %d and %d", got1, got2, wantFirst, wantSecond)
	}
	if point == crashAfterCommit {
		f.waitFor("the crashed message redelivered to the restarted child", func() bool {
			return f.count("SELECT count(*) FROM deliveries WHERE message_id = $1 AND pid = $2", crashID, second.Pid()) >= 1
		})
	}
	if n := f.count("SELECT count(*) FROM inbox_processed_messages_attempts"); n != 0 {
		t.Fatalf("%d attempt records left after every message was processed", n)
	}
	t.Logf("batch of %d at the crash; took %s", members, time.Since(start).Round(time.Millisecond))
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// crashNow prints the CRASH line and SIGKILLs the process: no deferred function, no ack, no
// rollback runs.
func crashNow(point, id string, members int) {
	fmt.Printf("CRASH %s %s members=%d\n", point, id, members) // os.Stdout is unbuffered
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

// crashStore chooses the crash message, the second member of the first batch claim of two or
// more members (deliveries claimed alone before it run normally), notes that batch's size
// and, at the before-claim point, kills the process when its claim is about to be sent: the
// batch holds nothing yet.
type crashStore struct {
	*pgstore.Store
	id      *atomic.Value // string: the chosen message ID, "" until chosen
	point   string
	members *atomic.Int64
}

func (s crashStore) ClaimBatch(ctx context.Context, ds []contract.Delivery) (contract.BatchTx, []contract.Claim, error) {
	if len(ds) >= 2 && s.id.CompareAndSwap("", ds[1].Key.MessageID) {
		s.members.Store(int64(len(ds)))
		if s.point == crashBeforeClaim {
			crashNow(crashBeforeClaim, ds[1].Key.MessageID, len(ds))
		}
	}
	return s.Store.ClaimBatch(ctx, ds)
}

// batchedChild is Child in the batched mode: the inbox batches up to ADAPTERTEST_BATCH_SIZE
// deliveries (Linger 1 s, so the deliveries the broker hands out close together meet), with a
// dead-letter topic and the broker's redelivery signal (durable attempt counting on), and
// kills itself at the crash point when one is set.
func batchedChild(t *testing.T, h Harness) {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	pool := inboxtest.NewPool(t, os.Getenv(envDB), 8)
	b, err := h.NewBroker(pool, os.Getenv(envGroup))
	if err != nil {
		t.Fatalf("child: broker: %v", err)
	}
	store, err := pgstore.New(pool, pgstore.Config{Schema: os.Getenv(envSch)})
	if err != nil {
		t.Fatal(err)
	}
	point := os.Getenv(envCrashPoint)
	var members atomic.Int64
	var chosen atomic.Value // the crash message: a member of the first batch of two or more
	chosen.Store("")
	var s inbox.Store = store
	if point != "" {
		s = crashStore{Store: store, id: &chosen, point: point, members: &members}
	}
	crashOn := func(msg *message.Message) bool { return msg.UUID == chosen.Load().(string) }
	size, _ := strconv.Atoi(os.Getenv(envBatchSize))
	handlers, _ := strconv.Atoi(os.Getenv(envHandlers))
	topic := os.Getenv(envTopic)
	ib, err := inbox.New(inbox.Config{
		Store: s, ConsumerName: consumerName, BrokerSideFields: b.BrokerSideFields, Redelivery: b.Redelivery,
		DeadLetterPublisher: b.Publisher, DeadLetterTopic: topic + "_dead",
		// The backlog is published before the child starts, but its records reach the
		// handlers as each partition's claim starts (on Kafka, after the first-delivery
		// signal reads the partition's high watermark): a long linger gathers them into one
		// batch however far apart they arrive. The batch still starts at once when full.
		Batch: inbox.BatchConfig{Size: size, Linger: time.Second},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	pid := os.Getpid()
	r.AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			_, _ = pool.Exec(context.WithoutCancel(msg.Context()), "INSERT INTO deliveries VALUES ($1, $2)", msg.UUID, pid)
			out, err := next(msg)
			if err == nil && point == crashAfterCommit && crashOn(msg) {
				crashNow(crashAfterCommit, msg.UUID, int(members.Load())) // the batch committed; no ack yet
			}
			if err != nil {
				time.Sleep(20 * time.Millisecond)
			}
			return out, err
		}
	})
	handler := batchHandler(pool, pid, func(msg *message.Message) {
		if point == crashInHandler && crashOn(msg) {
			crashNow(crashInHandler, msg.UUID, int(members.Load())) // after its UPDATE, before the COMMIT
		}
	})
	wrapped := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, handler(msg) })
	for k := range max(handlers, 1) {
		r.AddConsumerHandler(fmt.Sprintf("%s-%d", consumerName, k), topic, b.Subscriber, func(msg *message.Message) error {
			_, err := wrapped(msg)
			return err
		})
	}
	go func() { _ = r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("router did not start")
	}
	fmt.Printf("%s%d\n", readyLine, pid)
	inboxtest.WaitChildStop(t, ctx, "adaptertest batched child")
	_ = r.Close()
}

// batchHandler credits the payment and records its run, with the transaction ID, outside the
// transaction; then calls after (the crash point inside a handler).
func batchHandler(pool *pgxpool.Pool, pid int, after func(*message.Message)) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		tx, ok := pgstore.TxFromContext(ctx)
		if !ok {
			return errors.New("no inbox transaction")
		}
		var txid int64
		if err := tx.QueryRow(ctx, "SELECT txid_current()").Scan(&txid); err != nil {
			return err
		}
		if _, err := pool.Exec(ctx, "INSERT INTO batch_runs VALUES ($1, $2, $3)", msg.UUID, txid, pid); err != nil {
			return err
		}
		var p payment
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return inbox.Permanent(err)
		}
		if _, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + $1 WHERE id = $2", p.Amount, p.Account); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "INSERT INTO applied VALUES ($1)", msg.UUID); err != nil {
			return err
		}
		after(msg)
		return nil
	}
}
