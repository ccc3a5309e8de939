package deferred_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// twoWeeks is the retention of the purge tests: 14 days, the default redelivery window (7
// days) and margin (1 day).
var twoWeeks = inbox.Retention{Window: 14 * 24 * time.Hour}

// seed adds n rows of consumer with the given status, named prefix1..prefixN, with done_at
// (or dead_at, claimed_at) that long ago and received_at an hour before: the state a table is
// in after that much time, written straight in SQL.
func seed(t *testing.T, s *testenv.Schema, consumer, prefix, status string, n int, age string) {
	t.Helper()
	s.Exec(t, fmt.Sprintf(`INSERT INTO inbox_deferred (message_id, consumer_name, message_uuid, payload, payload_hash, status,
		received_at, done_at, dead_at, claimed_at, claim_token)
		SELECT '%[2]s' || g, '%[1]s', '%[2]s' || g, '\x00', '\x00', '%[3]s', now() - interval '%[5]s' - interval '1 hour',
		  CASE WHEN '%[3]s' = 'done' THEN now() - interval '%[5]s' END,
		  CASE WHEN '%[3]s' = 'dead' THEN now() - interval '%[5]s' END,
		  CASE WHEN '%[3]s' = 'processing' THEN now() - interval '%[5]s' END,
		  CASE WHEN '%[3]s' = 'processing' THEN gen_random_uuid() END
		FROM generate_series(1, %[4]d) g`, consumer, prefix, status, n, age))
}

// TestPurgeDeletesOnlyDoneRowsPastTheWindow: a dry run counts and changes nothing; the purge
// deletes exactly the consumer's done rows older than the window, in batches, and keeps done
// rows inside the window, pending, processing and dead rows however old, and other
// consumers' rows.
func TestPurgeDeletesOnlyDoneRowsPastTheWindow(t *testing.T) {
	ib, s := newInbox(t, deferred.Config{Retention: twoWeeks}, 0)
	seed(t, s, "billing", "old-done-", "done", 12, "20 days")
	seed(t, s, "billing", "new-done-", "done", 5, "13 days")
	seed(t, s, "billing", "old-pending-", "pending", 3, "90 days")
	seed(t, s, "billing", "old-processing-", "processing", 2, "90 days")
	seed(t, s, "billing", "old-dead-", "dead", 4, "90 days")
	seed(t, s, "shipping", "other-done-", "done", 6, "20 days")
	total := func() int64 { return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred") }
	before := total()

	rep, err := ib.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{DryRun: true})
	if err != nil || rep.Rows() != 12 || !rep.DryRun || total() != before {
		t.Fatalf("dry run: %v, %+v; %d rows left of %d", err, rep, total(), before)
	}
	var reports []pgstore.PurgeProgress
	rep, err = ib.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{BatchSize: 5, Pause: time.Millisecond,
		Progress: func(p pgstore.PurgeProgress) { reports = append(reports, p) }})
	if err != nil || rep.Rows() != 12 || len(rep.Tables) != 1 || rep.Tables[0].Batches != 3 || rep.Tables[0].Kind != deferred.PurgeKindDone {
		t.Fatalf("purge: %v, %+v", err, rep)
	}
	if len(reports) != 3 || reports[2].Rows != 12 || !reports[2].Done || reports[0].Done {
		t.Fatalf("progress reports %+v", reports)
	}
	if got := rep.Now.Sub(rep.Cutoff); got != twoWeeks.Window {
		t.Fatalf("cutoff %s before now, want the window", got)
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE message_id LIKE 'old-done-%'"); n != 0 || total() != before-12 {
		t.Fatalf("%d old done rows left, %d rows in all (want %d)", n, total(), before-12)
	}
	for status, want := range map[string]int64{"pending": 3, "processing": 2, "dead": 4} {
		if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = $1", status); n != want {
			t.Fatalf("%d %s rows, want %d", n, status, want)
		}
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE message_id LIKE 'new-done-%' OR consumer_name = 'shipping'"); n != 11 {
		t.Fatalf("%d rows inside the window or of the other consumer, want 11", n)
	}

	// Without a retention window the purge refuses; a window below the redelivery window is
	// refused by New.
	plain := inboxOn(t, s.Pool, s.Name, deferred.Config{ConsumerName: "plain"})
	if _, err := plain.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{}); !errors.Is(err, pgstore.ErrNoRetention) {
		t.Fatalf("purge without a window: %v", err)
	}
	var re *inbox.RetentionError
	if _, err := deferred.New(deferred.Config{Pool: s.Pool, ConsumerName: "x", Retention: inbox.Retention{Window: 3 * 24 * time.Hour}}, nil); !errors.As(err, &re) || re.Field != "Window" {
		t.Fatalf("a 3-day window: %v, want a RetentionError on Window", err)
	}
	if _, err := deferred.New(deferred.Config{Pool: s.Pool, ConsumerName: "x", TooOld: inbox.TooOldGuard{ProducerTime: inbox.ProducerTimeFromUUIDv7()}}, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("a too-old guard without a window: %v", err)
	}
}

// TestPurgeKeepsWhatThePredecessorProbeReads: with producer sequences, the purge keeps the done
// row before an unfinished row, before a gap, before a row done inside the window, and each
// aggregate's latest row; so a late message, the next sequence number and a replay are all
// still handled in order after the purge, and nothing is handled twice.
func TestPurgeKeepsWhatThePredecessorProbeReads(t *testing.T) {
	ib, s := newInbox(t, deferred.Config{Retention: twoWeeks, Ordering: deferred.OrderProducerSequence, SequenceField: "seq"}, 3)
	receive := func(account, seq int) {
		t.Helper()
		if err := ib.Receive(payment(fmt.Sprintf("a%d-s%d", account, seq), account, 100, seq)); err != nil {
			t.Fatal(err)
		}
	}
	for seq := 1; seq <= 5; seq++ {
		receive(1, seq) // aggregate 1: 1..5, all done and old: 1..4 go, 5 (the latest) stays
	}
	for seq := 1; seq <= 4; seq++ {
		receive(2, seq) // aggregate 2: 1..3 old, 4 done inside the window: 1, 2 go
	}
	receive(3, 1) // aggregate 3: 1, 2 old, 3 late, 4 waiting: 1 goes, 2 stays
	receive(3, 2)
	w := ib.NewConsumerWorkers(credit)
	runWorkers(t, w)
	waitFor(t, 15*time.Second, "11 rows done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 11
	})
	receive(3, 4)
	time.Sleep(300 * time.Millisecond) // a claim would have taken it now: it waits for 3
	s.Exec(t, "UPDATE inbox_deferred SET done_at = done_at - interval '20 days' WHERE status = 'done' AND message_id <> 'a2-s4'")

	rep, err := ib.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{})
	if err != nil || rep.Rows() != 7 {
		t.Fatalf("purge: %v, %d rows, want 7", err, rep.Rows())
	}
	var left string
	if err := s.Pool.QueryRow(context.Background(), "SELECT string_agg(message_id || '=' || status, ',' ORDER BY message_id) FROM inbox_deferred").Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != "a1-s5=done,a2-s3=done,a2-s4=done,a3-s2=done,a3-s4=pending" {
		t.Fatalf("rows left: %s", left)
	}

	receive(1, 6) // the next number: its predecessor 5 was kept
	receive(3, 3) // the late message: 2 was kept, and 4 follows it
	if n, err := ib.Replay(context.Background(), deferred.ReplayParams{Keys: []string{"a2-s4"}}); err != nil || n != 1 {
		t.Fatalf("replay: %d, %v", n, err)
	}
	waitFor(t, 15*time.Second, "every row done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status <> 'done'") == 0
	})
	for account, want := range map[int]int64{1: 600, 2: 500, 3: 400} {
		if b := count(t, s.Pool, "SELECT balance FROM accounts WHERE id = $1", account); b != want {
			t.Fatalf("account %d: balance %d, want %d", account, b, want)
		}
	}
}

// TestTwoPurgesAtOnce: while one purge of a table and consumer runs (held inside its first
// batch's progress report), a second one, from another Inbox, returns ErrPurgeInProgress at
// once and deletes nothing; a purge of another consumer runs beside it; the first then
// finishes alone.
func TestTwoPurgesAtOnce(t *testing.T) {
	ib, s := newInbox(t, deferred.Config{Retention: twoWeeks}, 0)
	other := inboxOn(t, s.Pool, s.Name, deferred.Config{Retention: twoWeeks})
	shipping := inboxOn(t, s.Pool, s.Name, deferred.Config{ConsumerName: "shipping", Retention: twoWeeks})
	seed(t, s, "billing", "b-", "done", 20, "20 days")
	seed(t, s, "shipping", "s-", "done", 3, "20 days")
	inFirst, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	var first pgstore.PurgeReport
	var firstErr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		first, firstErr = ib.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{BatchSize: 5,
			Progress: func(pgstore.PurgeProgress) { once.Do(func() { close(inFirst); <-release }) }})
	}()
	<-inFirst
	rep, err := other.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{BatchSize: 5})
	if !errors.Is(err, pgstore.ErrPurgeInProgress) || rep.Rows() != 0 {
		t.Fatalf("second purge: %v, %d rows", err, rep.Rows())
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE consumer_name = 'billing'"); n != 15 {
		t.Fatalf("%d billing rows while the first purge is held after one batch, want 15", n)
	}
	if rep, err := shipping.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{}); err != nil || rep.Rows() != 3 {
		t.Fatalf("another consumer's purge beside it: %v, %d rows", err, rep.Rows())
	}
	close(release)
	<-done
	if firstErr != nil || first.Rows() != 20 {
		t.Fatalf("first purge: %v, %d rows", firstErr, first.Rows())
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred"); n != 0 {
		t.Fatalf("%d rows left", n)
	}
}

// TestWorkersProcessWhileAPurgeRuns: 20,000 expired done rows are purged in batches of 500 with
// a pause while 200 payments are received and handled: the workers finish rows between the
// purge's first and last batch, every payment is credited once, and the purge deletes exactly
// the expired rows.
func TestWorkersProcessWhileAPurgeRuns(t *testing.T) {
	ib, s := newInbox(t, deferred.Config{Retention: twoWeeks}, 4)
	seed(t, s, "billing", "expired-", "done", 20000, "20 days")
	runWorkers(t, ib.NewConsumerWorkers(credit))
	doneNow := func() int64 {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done' AND message_id LIKE 'pay-%'")
	}
	var atFirst, atLast atomic.Int64
	atFirst.Store(-1)
	purged := make(chan pgstore.PurgeReport, 1)
	purgeErr := make(chan error, 1)
	received := make(chan struct{})
	go func() {
		<-received // some payments are in
		rep, err := ib.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{BatchSize: 500, Pause: 20 * time.Millisecond,
			Progress: func(p pgstore.PurgeProgress) {
				n := doneNow()
				atFirst.CompareAndSwap(-1, n)
				atLast.Store(n)
			}})
		purged <- rep
		purgeErr <- err
	}()
	for k := range 200 {
		if k == 20 {
			close(received)
		}
		if err := ib.Receive(payment(fmt.Sprintf("pay-%d", k), k%4+1, 1, 0)); err != nil {
			t.Fatal(err)
		}
	}
	rep := <-purged
	if err := <-purgeErr; err != nil || rep.Rows() != 20000 {
		t.Fatalf("purge: %v, %d rows, want 20000", err, rep.Rows())
	}
	if atLast.Load() <= atFirst.Load() {
		t.Fatalf("no payment was handled while the purge ran (done at its first batch %d, at its last %d)", atFirst.Load(), atLast.Load())
	}
	waitFor(t, 30*time.Second, "200 payments done", func() bool { return doneNow() == 200 })
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred"); n != 200 {
		t.Fatalf("%d rows, want the 200 payments", n)
	}
	if b := count(t, s.Pool, "SELECT sum(balance) FROM accounts"); b != 200 {
		t.Fatalf("balances sum to %d, want 200 (each payment credited once)", b)
	}
	t.Logf("done payments at the purge's first batch %d, at its last %d", atFirst.Load(), atLast.Load())
}

// uuidV7At returns a UUIDv7 whose timestamp is at.
func uuidV7At(t *testing.T, at time.Time) string {
	t.Helper()
	u, err := uuid.NewV7()
	if err != nil {
		t.Fatal(err)
	}
	ms := at.UnixMilli()
	for k := 5; k >= 0; k-- {
		u[k] = byte(ms)
		ms >>= 8
	}
	return u.String()
}

// deadLetters returns a persistent in-memory dead-letter publisher and its subscription.
func deadLetters(t *testing.T) (message.Publisher, <-chan *message.Message) {
	t.Helper()
	dlq := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = dlq.Close() })
	letters, err := dlq.Subscribe(context.Background(), "dead")
	if err != nil {
		t.Fatal(err)
	}
	return dlq, letters
}

func nextLetter(t *testing.T, letters <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case dl := <-letters:
		dl.Ack()
		return dl
	case <-time.After(5 * time.Second):
		t.Fatal("dead letter missing")
		return nil
	}
}

// TestTooOldAtReceipt: with the guard on, a message produced before the window is dead-lettered
// at receipt with inbox.ReasonTooOld and no row is inserted; one produced an hour ahead is
// dead-lettered with inbox.ReasonFutureProducerTime; one inside the window, one replayed from
// a dead letter and, with ProcessTooOld, an old one are inserted. Without a dead-letter topic
// the refusal is a permanent error wrapping inbox.ErrTooOld.
func TestTooOldAtReceipt(t *testing.T) {
	dlq, letters := deadLetters(t)
	guard := inbox.TooOldGuard{ProducerTime: inbox.ProducerTimeFromUUIDv7()}
	ib, s := newInbox(t, deferred.Config{Retention: twoWeeks, TooOld: guard, DeadLetterPublisher: dlq, DeadLetterTopic: "dead"}, 1)
	now := time.Now()
	old := message.NewMessage(uuidV7At(t, now.Add(-15*24*time.Hour)), []byte(`{"account":1,"amount":1}`))
	future := message.NewMessage(uuidV7At(t, now.Add(time.Hour)), []byte(`{}`))
	fresh := message.NewMessage(uuidV7At(t, now.Add(-13*24*time.Hour)), []byte(`{}`))
	replayed := message.NewMessage(uuidV7At(t, now.Add(-20*24*time.Hour)), []byte(`{}`))
	replayed.Metadata.Set(inbox.DeadLetterReplayedKey, "1")
	for _, m := range []*message.Message{old, future, fresh, replayed} {
		if err := ib.Receive(m); err != nil {
			t.Fatalf("receive: %v", err)
		}
	}
	// Two dead letters, in either order (GoChannel does not keep the publish order).
	want := map[string]string{old.UUID: inbox.ReasonTooOld, future.UUID: inbox.ReasonFutureProducerTime}
	for range 2 {
		dl := nextLetter(t, letters)
		reason, ok := want[dl.UUID]
		if !ok || dl.Metadata.Get(wmmiddleware.ReasonForPoisonedKey) != reason || dl.Metadata.Get(inbox.DeadLetterConsumerKey) != "billing" {
			t.Fatalf("dead letter %s: %v, want one of %v with its reason", dl.UUID, dl.Metadata, want)
		}
		delete(want, dl.UUID)
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE message_id = ANY($1)", []string{old.UUID, future.UUID}); n != 0 {
		t.Fatalf("%d rows stored for the refused messages", n)
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE message_id = ANY($1)", []string{fresh.UUID, replayed.UUID}); n != 2 {
		t.Fatalf("%d rows for the message inside the window and the replayed one, want 2", n)
	}
	if c := ib.Counters(); c.TooOld != 2 || c.Refused != 2 || c.Received != 2 {
		t.Fatalf("counters %+v", c)
	}

	nack := inboxOn(t, s.Pool, s.Name, deferred.Config{ConsumerName: "nack", Retention: twoWeeks, TooOld: guard})
	if err := nack.Receive(old.Copy()); !errors.Is(err, inbox.ErrTooOld) || !inbox.IsPermanent(err) {
		t.Fatalf("too old without a dead-letter topic: %v, want a permanent ErrTooOld", err)
	}
	guard.ProcessTooOld = true
	anyway := inboxOn(t, s.Pool, s.Name, deferred.Config{ConsumerName: "anyway", Retention: twoWeeks, TooOld: guard})
	if err := anyway.Receive(old.Copy()); err != nil {
		t.Fatal(err)
	}
	if err := anyway.Receive(future.Copy()); !errors.Is(err, inbox.ErrFutureProducerTime) {
		t.Fatalf("future-dated with ProcessTooOld: %v, want ErrFutureProducerTime", err)
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE consumer_name IN ('nack', 'anyway')"); n != 1 {
		t.Fatalf("%d rows of the nacking and the ProcessTooOld consumers, want 1 (ProcessTooOld's old message)", n)
	}
}

// TestOutageRedeliveryAfterThePurge: payments are received and handled; the clock moves past
// the retention window (the guard's clock, and done_at as the database would see it then);
// the purge deletes their rows; the broker then redelivers every one of them (an outage, an
// offset reset): the guard dead-letters each as too old, no row comes back and no account is
// credited twice. A payment produced after the move is handled normally.
func TestOutageRedeliveryAfterThePurge(t *testing.T) {
	dlq, letters := deadLetters(t)
	var shift atomic.Int64
	clock := func() time.Time { return time.Now().Add(time.Duration(shift.Load())) }
	window := inbox.Retention{Window: 8 * 24 * time.Hour} // the shortest with the defaults (7d + 1d)
	ib, s := newInbox(t, deferred.Config{Retention: window, DeadLetterPublisher: dlq, DeadLetterTopic: "dead",
		TooOld: inbox.TooOldGuard{ProducerTime: inbox.ProducerTimeFromUUIDv7(), Now: clock}}, 2)
	runWorkers(t, ib.NewConsumerWorkers(credit))
	var sent []*message.Message
	for k := range 10 {
		m := message.NewMessage(uuidV7At(t, time.Now().Add(-24*time.Hour)), []byte(fmt.Sprintf(`{"account":%d,"amount":10}`, k%2+1)))
		sent = append(sent, m)
		if err := ib.Receive(m.Copy()); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 15*time.Second, "10 payments done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 10
	})

	// Nine days later.
	shift.Store(int64(9 * 24 * time.Hour))
	s.Exec(t, "UPDATE inbox_deferred SET done_at = done_at - interval '9 days', received_at = received_at - interval '9 days'")
	if rep, err := ib.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{}); err != nil || rep.Rows() != 10 {
		t.Fatalf("purge: %v, %d rows, want 10", err, rep.Rows())
	}
	for _, m := range sent {
		if err := ib.Receive(m.Copy()); err != nil {
			t.Fatalf("redelivery: %v", err)
		}
		if dl := nextLetter(t, letters); dl.UUID != m.UUID || dl.Metadata.Get(wmmiddleware.ReasonForPoisonedKey) != inbox.ReasonTooOld {
			t.Fatalf("dead letter %s (%q), want %s as too old", dl.UUID, dl.Metadata.Get(wmmiddleware.ReasonForPoisonedKey), m.UUID)
		}
	}
	fresh := message.NewMessage(uuidV7At(t, clock().Add(-time.Hour)), []byte(`{"account":1,"amount":1}`))
	if err := ib.Receive(fresh); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 15*time.Second, "the new payment done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 1
	})
	time.Sleep(300 * time.Millisecond)
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred"); n != 1 {
		t.Fatalf("%d rows, want only the new payment's", n)
	}
	for account, want := range map[int]int64{1: 51, 2: 50} {
		if b := count(t, s.Pool, "SELECT balance FROM accounts WHERE id = $1", account); b != want {
			t.Fatalf("account %d: balance %d, want %d (each payment credited once)", account, b, want)
		}
	}
}
