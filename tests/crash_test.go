package tests

import (
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// crashFixture is one crash test's world: a schema with the bank tables, a queue holding five
// payments to account 1, and the index of the payment the first child dies on.
type crashFixture struct {
	schema  *testenv.Schema
	store   *pgstore.Store
	rabbit  *rabbitAdmin
	queue   string
	msgs    []*message.Message
	amounts []int64
	crashAt int
}

func newCrashFixture(t *testing.T) *crashFixture {
	t.Helper()
	f := &crashFixture{
		schema:  testenv.NewSchema(t, 4),
		rabbit:  newRabbitAdmin(t),
		amounts: []int64{1, 10, 100, 1000, 10000}, // distinct digits: the balance shows which ran
		crashAt: 2,
	}
	f.store = setupBank(t, f.schema, 1)
	f.queue = f.rabbit.newQueue(t)
	for _, a := range f.amounts {
		f.msgs = append(f.msgs, paymentMsg(t, watermill.NewUUID(), 1, a))
	}
	f.rabbit.publish(t, f.queue, f.msgs...)
	if ready, _ := f.rabbit.queueState(t, f.queue); ready != len(f.msgs) {
		t.Fatalf("queue holds %d messages after publishing %d", ready, len(f.msgs))
	}
	return f
}

func (f *crashFixture) sum(upTo int) (s int64) {
	for _, a := range f.amounts[:upTo] {
		s += a
	}
	return s
}

func (f *crashFixture) balance(t *testing.T) int64 {
	return queryInt(t, f.schema.Pool, "SELECT balance FROM accounts WHERE id = 1")
}

func (f *crashFixture) inboxRows(t *testing.T) int64 {
	return queryInt(t, f.schema.Pool, "SELECT count(*) FROM "+f.store.Table()+" WHERE consumer_name = $1", bankConsumerName)
}

func (f *crashFixture) crashID() string { return f.msgs[f.crashAt].UUID }

// runFirstChildUntilCrash starts a child that SIGKILLs itself at the crash point given by
// crashEnv, and checks it died of SIGKILL at that point.
func (f *crashFixture) runFirstChildUntilCrash(t *testing.T, crashEnv, where string) *childProc {
	t.Helper()
	child := startChild(t, f.schema, f.rabbit.url, f.queue, crashEnv+"="+f.crashID())
	err := child.WaitExit(t, 30*time.Second)
	if !testenv.KilledBySIGKILL(err) {
		t.Fatalf("first child should have died of SIGKILL, got %v", err)
	}
	want := fmt.Sprintf("CRASH %s %s", where, f.crashID())
	if line, ok := child.Find("CRASH "); !ok || line != want {
		t.Fatalf("first child died without reaching the injected crash point: CRASH line %q, want %q", line, want)
	}
	// RabbitMQ saw the connection drop and requeued the unacked delivery: the crashed message
	// and the two after it are ready again.
	waitUntil(t, 10*time.Second, "RabbitMQ to requeue the unacked message", func() (bool, string) {
		ready, consumers := f.rabbit.queueState(t, f.queue)
		return ready == len(f.msgs)-f.crashAt && consumers == 0, fmt.Sprintf("ready=%d consumers=%d", ready, consumers)
	})
	return child
}

// runSecondChildToCompletion starts a child without a crash flag and waits until the queue is
// drained, every message has its inbox row and wantDeliveries deliveries were recorded.
func (f *crashFixture) runSecondChildToCompletion(t *testing.T, wantDeliveries int64) *childProc {
	t.Helper()
	child := startChild(t, f.schema, f.rabbit.url, f.queue)
	waitUntil(t, 20*time.Second, "the restarted consumer to drain the queue", func() (bool, string) {
		ready, _ := f.rabbit.queueState(t, f.queue)
		rows := f.inboxRows(t)
		d := queryInt(t, f.schema.Pool, "SELECT count(*) FROM deliveries")
		// >= rather than ==: a consumer that processes too much ends the wait at once and
		// fails on the exact assertions that follow.
		return ready == 0 && rows >= int64(len(f.msgs)) && d >= wantDeliveries,
			fmt.Sprintf("ready=%d inbox rows=%d deliveries=%d (want %d)", ready, rows, d, wantDeliveries)
	})
	time.Sleep(ackGrace)
	return child
}

// assertFinalState checks the business state after both children ran: every payment applied
// exactly once, one inbox row per message, nothing left in the queue (every delivery acked).
func (f *crashFixture) assertFinalState(t *testing.T) {
	t.Helper()
	if got, want := f.balance(t), f.sum(len(f.amounts)); got != want {
		t.Errorf("balance = %d, want %d (each payment exactly once)", got, want)
	}
	if got := f.inboxRows(t); got != int64(len(f.msgs)) {
		t.Errorf("inbox rows = %d, want %d", got, len(f.msgs))
	}
	for _, m := range f.msgs {
		if n := queryInt(t, f.schema.Pool, "SELECT count(*) FROM "+f.store.Table()+" WHERE message_id = $1", m.UUID); n != 1 {
			t.Errorf("inbox rows for %s = %d, want 1", m.UUID, n)
		}
	}
	if ready, consumers := f.rabbit.queueState(t, f.queue); ready != 0 || consumers != 0 {
		t.Errorf("queue after both consumers stopped: ready=%d consumers=%d, want 0 and 0 (a message was left unacked)", ready, consumers)
	}
}

// TestCrashAfterCommitBeforeAck kills the consumer process with SIGKILL after the inbox
// committed a message and before the router acked it. RabbitMQ redelivers the message to the
// restarted consumer, whose inbox recognises it as a duplicate: the handler does not run again
// and the payment is applied once.
func TestCrashAfterCommitBeforeAck(t *testing.T) {
	start := time.Now()
	f := newCrashFixture(t)
	first := f.runFirstChildUntilCrash(t, envCrashAfterCommit, "after-commit")
	firstPID := first.Pid()

	// The crash came after the commit: the crashed message's payment and inbox row are there.
	if got, want := f.balance(t), f.sum(f.crashAt+1); got != want {
		t.Fatalf("balance after the crash = %d, want %d (payments 1..%d committed)", got, want, f.crashAt+1)
	}
	if got := f.inboxRows(t); got != int64(f.crashAt+1) {
		t.Fatalf("inbox rows after the crash = %d, want %d", got, f.crashAt+1)
	}

	// 5 first deliveries + 1 redelivery of the crashed message.
	second := f.runSecondChildToCompletion(t, int64(len(f.msgs)+1))
	st := second.stop(t)
	f.assertFinalState(t)

	// The redelivery reached the restarted consumer, flagged redelivered by RabbitMQ...
	rows, err := f.schema.Pool.Query(t.Context(), "SELECT redelivered, pid FROM deliveries WHERE message_id = $1 ORDER BY id", f.crashID())
	if err != nil {
		t.Fatal(err)
	}
	type delivery struct {
		redelivered bool
		pid         int
	}
	var ds []delivery
	for rows.Next() {
		var d delivery
		if err := rows.Scan(&d.redelivered, &d.pid); err != nil {
			t.Fatal(err)
		}
		ds = append(ds, d)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	secondPID := second.Pid()
	if len(ds) != 2 || ds[0].pid != firstPID || ds[0].redelivered || ds[1].pid != secondPID || !ds[1].redelivered {
		t.Errorf("deliveries of the crashed message = %+v, want one by pid %d (not redelivered) then one by pid %d (redelivered)", ds, firstPID, secondPID)
	}
	// ...and was skipped as a duplicate: the handler ran once for it, in the first process.
	if n := queryInt(t, f.schema.Pool, "SELECT count(*) FROM handler_runs WHERE message_id = $1", f.crashID()); n != 1 {
		t.Errorf("handler runs for the crashed message = %d, want 1", n)
	}
	if n := queryInt(t, f.schema.Pool, "SELECT count(*) FROM handler_runs WHERE pid = $1", secondPID); n != int64(len(f.msgs)-f.crashAt-1) {
		t.Errorf("handler runs in the restarted consumer = %d, want %d", n, len(f.msgs)-f.crashAt-1)
	}
	if want := (uint64(len(f.msgs) - f.crashAt - 1)); st.Processed != want || st.Duplicates != 1 || st.Failed != 0 {
		t.Errorf("restarted consumer stats = %+v, want processed=%d duplicates=1 failed=0", st, want)
	}
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}

// TestCrashBeforeCommit kills the consumer process with SIGKILL inside the handler, after its
// UPDATE and before the inbox commits. PostgreSQL rolls the transaction back (claim included),
// RabbitMQ redelivers, and the restarted consumer does the work: the payment is applied once.
func TestCrashBeforeCommit(t *testing.T) {
	start := time.Now()
	f := newCrashFixture(t)
	first := f.runFirstChildUntilCrash(t, envCrashBeforeCommit, "before-commit")
	firstPID := first.Pid()

	// The crash came before the commit: neither the payment nor the claim is visible.
	if got, want := f.balance(t), f.sum(f.crashAt); got != want {
		t.Fatalf("balance after the crash = %d, want %d (payments 1..%d committed)", got, want, f.crashAt)
	}
	if got := f.inboxRows(t); got != int64(f.crashAt) {
		t.Fatalf("inbox rows after the crash = %d, want %d", got, f.crashAt)
	}
	// The handler did run (and update) for it in the killed process.
	if n := queryInt(t, f.schema.Pool, "SELECT count(*) FROM handler_runs WHERE message_id = $1 AND pid = $2", f.crashID(), firstPID); n != 1 {
		t.Fatalf("handler runs for the crashed message in the first process = %d, want 1", n)
	}

	second := f.runSecondChildToCompletion(t, int64(len(f.msgs)+1))
	st := second.stop(t)
	f.assertFinalState(t)

	secondPID := second.Pid()
	// The redelivery ran the handler again (no processed mark survived the crash).
	if n := queryInt(t, f.schema.Pool, "SELECT count(*) FROM handler_runs WHERE message_id = $1 AND pid = $2", f.crashID(), secondPID); n != 1 {
		t.Errorf("handler runs for the crashed message in the restarted consumer = %d, want 1", n)
	}
	if n := queryInt(t, f.schema.Pool, "SELECT count(*) FROM deliveries WHERE message_id = $1 AND pid = $2 AND redelivered", f.crashID(), secondPID); n != 1 {
		t.Errorf("redeliveries of the crashed message to the restarted consumer = %d, want 1", n)
	}
	if want := uint64(len(f.msgs) - f.crashAt); st.Processed != want || st.Duplicates != 0 || st.Failed != 0 {
		t.Errorf("restarted consumer stats = %+v, want processed=%d duplicates=0 failed=0", st, want)
	}
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}
