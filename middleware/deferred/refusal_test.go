package deferred_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// dlqueue is a dead-letter topic on a Go channel and its subscription.
type dlqueue struct {
	pub     message.Publisher
	letters <-chan *message.Message
}

func newDeadLetters(t *testing.T) *dlqueue {
	t.Helper()
	pub, letters := deadLetters(t)
	return &dlqueue{pub: pub, letters: letters}
}

// next returns the reason of the next dead letter, failing t when none comes within 5 s.
func (d *dlqueue) next(t *testing.T, what string) string {
	t.Helper()
	select {
	case dl := <-d.letters:
		dl.Ack()
		return dl.Metadata.Get(wmmiddleware.ReasonForPoisonedKey)
	case <-time.After(5 * time.Second):
		t.Fatalf("%s: no dead letter", what)
		return ""
	}
}

// none fails t when a dead letter arrives within wait.
func (d *dlqueue) none(t *testing.T, what string, wait time.Duration) {
	t.Helper()
	select {
	case dl := <-d.letters:
		t.Fatalf("%s: unexpected dead letter %q", what, dl.Metadata.Get(wmmiddleware.ReasonForPoisonedKey))
	case <-time.After(wait):
	}
}

// receiveOnTopic delivers msg on topic through a router (which puts the topic in the message's
// context, as for every subscriber) to ib.Receive, and returns how many times the receipt ran
// within a second and the errors it returned: a message the router nacks is redelivered at
// once by the Go channel, so a retryable refusal shows as a hot loop.
func receiveOnTopic(t *testing.T, ib *deferred.Inbox, topic string, msg *message.Message) (int64, []error) {
	t.Helper()
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer pubsub.Close()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	var mu sync.Mutex
	var errs []error
	r.AddConsumerHandler("receipt", topic, pubsub, func(m *message.Message) error {
		calls.Add(1)
		err := ib.Receive(m)
		if err != nil {
			mu.Lock()
			if len(errs) < 5 {
				errs = append(errs, err)
			}
			mu.Unlock()
			if calls.Load() > 50 {
				time.Sleep(10 * time.Millisecond) // a hot loop: keep the test's log and CPU sane
			}
		}
		return err
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(ctx) }()
	<-r.Running()
	if err := pubsub.Publish(topic, msg); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	cancel()
	<-done
	mu.Lock()
	defer mu.Unlock()
	return calls.Load(), errs
}

// TestReceiptUnstorableIsPermanent: a receipt whose topic, metadata, key or aggregate key
// PostgreSQL cannot store as it is (invalid UTF-8, NUL, over the limit) runs once: it is
// dead-lettered with a reason naming what was refused, acked, and stores nothing; without a
// dead-letter topic the error is permanent (never a hot retry of a retryable error).
func TestReceiptUnstorableIsPermanent(t *testing.T) {
	dlq := newDeadLetters(t)
	ib, s := newInbox(t, deferred.Config{DeadLetterPublisher: dlq.pub, DeadLetterTopic: "dead"}, 0)
	plain := inboxOn(t, s.Pool, s.Name, deferred.Config{ConsumerName: "plain"})
	long := strings.Repeat("t", inbox.MaxKeyBytes+1)
	withMeta := func(k, v string) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		m.Metadata.Set(k, v)
		return m
	}
	cases := []struct {
		name, topic, want string
		msg               func() *message.Message
	}{
		{"topic invalid UTF-8", "payments\xff", "topic", nil},
		{"topic NUL", "pay\x00ments", "topic", nil},
		{"topic oversized", long, "topic", nil},
		{"metadata key invalid UTF-8", "payments", "metadata", func() *message.Message { return withMeta("k\xff", "v") }},
		{"metadata value invalid UTF-8", "payments", "metadata", func() *message.Message { return withMeta("k", "v\xfe") }},
		{"metadata value NUL", "payments", "metadata", func() *message.Message { return withMeta("k", "a\x00b") }},
		{"key invalid UTF-8", "payments", "message UUID", func() *message.Message { return message.NewMessage("k\xff", []byte(`{}`)) }},
		{"key NUL", "payments", "message UUID", func() *message.Message { return message.NewMessage("k\x00", []byte(`{}`)) }},
		{"key oversized", "payments", "message UUID", func() *message.Message { return message.NewMessage(long, []byte(`{}`)) }},
		{"aggregate invalid UTF-8", "payments", "aggregate key", func() *message.Message { return withMeta("aggregate_id", "a\xff") }},
		{"aggregate NUL", "payments", "aggregate key", func() *message.Message { return withMeta("aggregate_id", "a\x00") }},
		{"aggregate oversized", "payments", "aggregate key", func() *message.Message { return withMeta("aggregate_id", long) }},
	}
	for _, c := range cases {
		msg := func() *message.Message { return message.NewMessage(watermill.NewUUID(), []byte(`{}`)) }
		if c.msg != nil {
			msg = c.msg
		}
		calls, errs := receiveOnTopic(t, ib, c.topic, msg())
		if calls != 1 || len(errs) != 0 {
			t.Errorf("%s: the receipt ran %d times (errors %v), want once, acked", c.name, calls, errs)
			continue
		}
		if reason := dlq.next(t, c.name); !strings.Contains(reason, c.want) || !strings.HasPrefix(reason, "permanent error") {
			t.Errorf("%s: dead letter reason %q, want a permanent error naming %q", c.name, reason, c.want)
		}
		// Without a dead-letter topic: a permanent error, nacked once per delivery by the router
		// (a PoisonQueue middleware filtering on inbox.IsPermanent takes it).
		calls, errs = receiveOnTopic(t, plain, c.topic, msg())
		if len(errs) == 0 || !inbox.IsPermanent(errs[0]) {
			t.Errorf("%s without a dead-letter topic: errors %v (%d receipts), want a permanent error", c.name, errs, calls)
		}
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred"); n != 0 {
		t.Fatalf("%d rows stored, want none", n)
	}
	if got := ib.Counters().Refused; got != uint64(len(cases)) {
		t.Fatalf("%d receipts refused, want %d", got, len(cases))
	}
}

// TestReceiptUnreachableSequence: with producer sequences, a receipt the ordering rule can never
// reach is refused at receipt (dead-lettered with its reason, nothing stored): a sequence below
// FirstSequence (0 and negative with the default 1; 4 with FirstSequence 5), a missing or
// non-number sequence, and a sequence already used in the aggregate by another message with
// another payload, done or not; the same payload under another key is a duplicate. Every valid
// row is then handled, in order.
func TestReceiptUnreachableSequence(t *testing.T) {
	dlq := newDeadLetters(t)
	cfg := deferred.Config{DeadLetterPublisher: dlq.pub, DeadLetterTopic: "dead", Ordering: deferred.OrderProducerSequence, SequenceField: "seq"}
	ib, s := newInbox(t, cfg, 2)
	withSeq := func(id, seq string, amount int) *message.Message {
		m := payment(id, 1, amount, 0)
		if seq != "-" {
			m.Metadata.Set("seq", seq)
		}
		return m
	}
	for _, c := range []struct{ name, seq string }{
		{"zero", "0"}, {"negative", "-1"}, {"minimum int64", "-9223372036854775808"},
		{"not a number", "abc"}, {"a fraction", "1.5"}, {"empty", ""}, {"missing", "-"}, {"overflow", "9223372036854775808"},
	} {
		if err := ib.Receive(withSeq("bad-"+c.name, c.seq, 1)); err != nil {
			t.Fatalf("%s: %v, want a dead letter and an ack", c.name, err)
		}
		if reason := dlq.next(t, c.name); !strings.Contains(reason, "sequence") {
			t.Fatalf("%s: reason %q, want the sequence named", c.name, reason)
		}
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred"); n != 0 {
		t.Fatalf("%d rows stored for unreachable sequences, want none", n)
	}

	// Sequence 1 is handled; then another message at 1 with another payload is refused, and one
	// with the same payload is a duplicate. A repeat of a pending sequence (2) is refused too.
	if err := ib.Receive(withSeq("ok-1", "1", 100)); err != nil {
		t.Fatal(err)
	}
	w := ib.NewConsumerWorkers(credit)
	runWorkers(t, w)
	waitFor(t, 10*time.Second, "sequence 1 done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 1
	})
	dups := ib.Counters().Duplicates
	if err := ib.Receive(withSeq("again-1", "1", 999)); err != nil {
		t.Fatalf("a done sequence with another payload: %v", err)
	}
	if reason := dlq.next(t, "done sequence reused"); !strings.Contains(reason, "sequence") {
		t.Fatalf("reason %q, want the sequence named", reason)
	}
	if err := ib.Receive(withSeq("copy-1", "1", 100)); err != nil {
		t.Fatalf("a done sequence with the same payload: %v", err)
	}
	dlq.none(t, "same payload under another key", 200*time.Millisecond)
	if got := ib.Counters().Duplicates; got != dups+1 {
		t.Fatalf("duplicates %d, want %d", got, dups+1)
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred"); n != 1 {
		t.Fatalf("%d rows, want 1", n)
	}
	if err := ib.Receive(withSeq("ok-3", "3", 1)); err != nil { // 2 is late: 3 waits
		t.Fatal(err)
	}
	if err := ib.Receive(withSeq("other-3", "3", 7)); err != nil {
		t.Fatal(err)
	}
	if reason := dlq.next(t, "pending sequence reused"); !strings.Contains(reason, "sequence") {
		t.Fatalf("reason %q, want the sequence named", reason)
	}
	if err := ib.Receive(withSeq("ok-2", "2", 10)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "sequences 2 and 3 done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 3
	})
	if b := count(t, s.Pool, "SELECT balance FROM accounts WHERE id = 1"); b != 111 {
		t.Fatalf("balance %d, want 111 (1, 2 and 3 once each, no refused message)", b)
	}

	// FirstSequence 5: 4 is below it.
	cfg.FirstSequence, cfg.ConsumerName = 5, "five"
	five := inboxOn(t, s.Pool, s.Name, cfg)
	if err := five.Receive(withSeq("four", "4", 1)); err != nil {
		t.Fatal(err)
	}
	if reason := dlq.next(t, "below FirstSequence 5"); !strings.Contains(reason, "sequence") {
		t.Fatalf("reason %q", reason)
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE consumer_name = 'five'"); n != 0 {
		t.Fatalf("%d rows for FirstSequence 5, want none", n)
	}
}

// TestReceiptConcurrentSequenceReuse: eight messages with different keys and payloads at one
// sequence number of one aggregate, released together at a barrier: exactly one is stored, the
// seven others are refused (dead-lettered), whatever the interleaving.
func TestReceiptConcurrentSequenceReuse(t *testing.T) {
	dlq := newDeadLetters(t)
	ib, s := newInbox(t, deferred.Config{DeadLetterPublisher: dlq.pub, DeadLetterTopic: "dead",
		Ordering: deferred.OrderProducerSequence, SequenceField: "seq"}, 0)
	for round := range 5 {
		var start, wg sync.WaitGroup
		start.Add(1)
		errs := make([]error, 8)
		for k := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				m := payment(watermill.NewUUID(), round+1, k+1, 1)
				start.Wait()
				errs[k] = ib.Receive(m)
			}()
		}
		start.Done()
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		for k := range 7 {
			if reason := dlq.next(t, "reused sequence"); !strings.Contains(reason, "sequence") {
				t.Fatalf("round %d, letter %d: reason %q", round, k, reason)
			}
		}
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred"); n != 5 {
		t.Fatalf("%d rows, want 5 (one per aggregate)", n)
	}
}

// TestConsumerNameRule: deferred.New applies the immediate inbox's consumer-name rule: blank,
// over inbox.MaxConsumerNameBytes, invalid UTF-8, NUL and control characters are refused with
// inbox.ErrInvalidConfig, and inbox.New refuses the same names.
func TestConsumerNameRule(t *testing.T) {
	s := newSchemaOnly(t, 1)
	for _, name := range []string{"", " ", strings.Repeat("n", inbox.MaxConsumerNameBytes+1), "bill\xff", "bill\x00ing",
		"bill\ning", "bill\x1b[31ming", "\tbilling", "bill\u0085ing"} {
		_, err := deferred.New(deferred.Config{Pool: s.Pool, ConsumerName: name}, nil)
		if !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("consumer name %q: %v, want ErrInvalidConfig", name, err)
		}
		if _, err := inbox.New(inbox.Config{Store: s.Store(t), ConsumerName: name}, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("inbox.New accepted %q: %v", name, err)
		}
	}
	if _, err := deferred.New(deferred.Config{Pool: s.Pool, ConsumerName: strings.Repeat("é", inbox.MaxConsumerNameBytes/2)}, nil); err != nil {
		t.Fatalf("a name of %d bytes: %v", inbox.MaxConsumerNameBytes, err)
	}
}

// TestStatsStuckAggregates: with workers running, a late producer sequence (1 and 3 received,
// 2 missing) leaves its aggregate's head waiting; once it has waited longer than StuckAfter,
// Stats counts the aggregate as stuck while a moving aggregate is not; when 2 arrives, both
// are handled and nothing is stuck.
func TestStatsStuckAggregates(t *testing.T) {
	ib, s := newInbox(t, deferred.Config{Ordering: deferred.OrderProducerSequence, SequenceField: "seq", StuckAfter: time.Second}, 2)
	runWorkers(t, ib.NewConsumerWorkers(credit))
	for _, m := range []*message.Message{payment("a-1", 1, 1, 1), payment("a-3", 1, 100, 3), payment("b-1", 2, 1, 1)} {
		if err := ib.Receive(m); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 10*time.Second, "a-1 and b-1 done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 2
	})
	stuck := func() int64 {
		st, err := ib.Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return st.StuckAggregates
	}
	if n := stuck(); n != 0 {
		t.Fatalf("%d stuck aggregates before the threshold, want 0", n)
	}
	time.Sleep(1200 * time.Millisecond)
	if err := ib.Receive(payment("b-2", 2, 1, 2)); err != nil { // a moving aggregate
		t.Fatal(err)
	}
	if n := stuck(); n != 1 {
		t.Fatalf("%d stuck aggregates after the threshold, want 1 (the gap)", n)
	}
	if err := ib.Receive(payment("a-2", 1, 10, 2)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "every row done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 5
	})
	if n := stuck(); n != 0 {
		t.Fatalf("%d stuck aggregates once the gap is filled, want 0", n)
	}
	if b := count(t, s.Pool, "SELECT balance FROM accounts WHERE id = 1"); b != 111 {
		t.Fatalf("balance %d, want 111", b)
	}
}

// TestReceiptOversizedAndRefusedRows: with the row limits lowered (1 MiB a row, 1 KiB of
// metadata, standing for PostgreSQL's 1 GB and jsonb's 256 MB), a payload, metadata or whole
// row over them is refused once, permanent, with an *deferred.UnstorableError naming it; an
// insert that PostgreSQL refuses with a data exception (SQLSTATE 22021, raised here by a
// trigger) is permanent too, while one refused for want of resources (53100, disk full) stays
// retryable. Nothing is stored.
func TestReceiptOversizedAndRefusedRows(t *testing.T) {
	t.Cleanup(deferred.SetRowLimits(1<<20, 1<<10))
	dlq := newDeadLetters(t)
	ib, s := newInbox(t, deferred.Config{DeadLetterPublisher: dlq.pub, DeadLetterTopic: "dead"}, 0)
	plain := inboxOn(t, s.Pool, s.Name, deferred.Config{ConsumerName: "plain"})
	big := func(payload, meta int) func() *message.Message {
		return func() *message.Message {
			m := message.NewMessage(watermill.NewUUID(), make([]byte, payload))
			m.Metadata.Set("note", strings.Repeat("m", meta))
			return m
		}
	}
	for _, c := range []struct {
		name, field string
		msg         func() *message.Message
	}{
		{"payload over the row limit", "payload", big(1<<20+1, 1)},
		{"metadata over jsonb's limit", "metadata", big(1, 1<<10)},
		{"payload and metadata over the row limit", "row", big(1<<20-100, 1000)},
	} {
		if err := ib.Receive(c.msg()); err != nil {
			t.Fatalf("%s: %v, want a dead letter and an ack", c.name, err)
		}
		if reason := dlq.next(t, c.name); !strings.Contains(reason, "cannot store the "+c.field) {
			t.Fatalf("%s: reason %q, want the %s named", c.name, reason, c.field)
		}
		err := plain.Receive(c.msg())
		var uerr *deferred.UnstorableError
		if !inbox.IsPermanent(err) || !errors.As(err, &uerr) || uerr.Field != c.field || !errors.Is(err, deferred.ErrUnstorable) {
			t.Fatalf("%s without a dead-letter topic: %v, want a permanent *UnstorableError for the %s", c.name, err, c.field)
		}
	}
	s.Exec(t, `CREATE FUNCTION refuse_row() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'refused' USING ERRCODE = NEW.topic; END $$`)
	s.Exec(t, `CREATE TRIGGER refuse_row BEFORE INSERT ON inbox_deferred FOR EACH ROW WHEN (NEW.topic <> '') EXECUTE FUNCTION refuse_row()`)
	calls, errs := receiveOnTopic(t, plain, "22021", message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
	var uerr *deferred.UnstorableError
	if len(errs) == 0 || !inbox.IsPermanent(errs[0]) || !errors.As(errs[0], &uerr) || uerr.Field != "row" || !strings.Contains(uerr.Reason, "22021") {
		t.Fatalf("a data exception: %v (%d receipts), want a permanent *UnstorableError", errs, calls)
	}
	if calls, errs = receiveOnTopic(t, ib, "22021", message.NewMessage(watermill.NewUUID(), []byte(`{}`))); calls != 1 || len(errs) != 0 {
		t.Fatalf("a data exception with a dead-letter topic: %d receipts, errors %v; want one, acked", calls, errs)
	}
	if reason := dlq.next(t, "a data exception"); !strings.Contains(reason, "SQLSTATE 22021") {
		t.Fatalf("reason %q", reason)
	}
	_, errs = receiveOnTopic(t, ib, "53100", message.NewMessage(watermill.NewUUID(), []byte(`{}`)))
	if len(errs) == 0 || inbox.IsPermanent(errs[0]) {
		t.Fatalf("disk full: %v, want a retryable error", errs)
	}
	dlq.none(t, "disk full", 100*time.Millisecond)
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred"); n != 0 {
		t.Fatalf("%d rows stored, want none", n)
	}
}
