package inbox_test

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

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// deadLetters is a dead-letter topic on Watermill's GoChannel, with a subscriber that collects
// what arrives, and a switch that makes Publish fail (a broker outage).
type deadLetters struct {
	pubsub *gochannel.GoChannel
	down   atomic.Bool
	mu     sync.Mutex
	got    []*message.Message
}

const dlTopic = "payments.dead"

func newDeadLetters(t *testing.T) *deadLetters {
	d := &deadLetters{pubsub: gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 100}, watermill.NopLogger{})}
	ch, err := d.pubsub.Subscribe(context.Background(), dlTopic)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for m := range ch {
			m.Ack()
			d.mu.Lock()
			d.got = append(d.got, m)
			d.mu.Unlock()
		}
	}()
	t.Cleanup(func() { _ = d.pubsub.Close() })
	return d
}

func (d *deadLetters) Publish(topic string, msgs ...*message.Message) error {
	if d.down.Load() {
		return errors.New("dead-letter broker unavailable")
	}
	return d.pubsub.Publish(topic, msgs...)
}

func (d *deadLetters) Close() error { return nil }

// wait returns the dead letters once n arrived (or fails t after 5 s).
func (d *deadLetters) wait(t *testing.T, n int) []*message.Message {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		d.mu.Lock()
		got := append([]*message.Message(nil), d.got...)
		d.mu.Unlock()
		if len(got) >= n || time.Now().After(deadline) {
			if len(got) != n {
				t.Fatalf("dead letters: %d, want %d", len(got), n)
			}
			return got
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func withDeadLetters(d *deadLetters, maxAttempts int) func(*inbox.Config) {
	return func(c *inbox.Config) {
		c.DeadLetterPublisher = d
		c.DeadLetterTopic = dlTopic
		c.MaxAttempts = maxAttempts
	}
}

func (e *env) attemptsRow(id string) (attempts int, lastError string, dead bool) {
	e.t.Helper()
	var le *string
	err := e.sch.Pool.QueryRow(context.Background(),
		"SELECT attempts, last_error, dead_lettered_at IS NOT NULL FROM inbox_processed_messages_attempts WHERE message_id = $1", id).
		Scan(&attempts, &le, &dead)
	if err != nil {
		return 0, "", false
	}
	if le != nil {
		lastError = *le
	}
	return attempts, lastError, dead
}

func TestPoisonMessageDeadLetteredAfterMaxAttempts(t *testing.T) {
	e := newEnv(t, 2)
	dl := newDeadLetters(t)
	healthy := false
	handler := func(msg *message.Message) ([]*message.Message, error) {
		if _, err := e.credit(msg); err != nil {
			return nil, err
		}
		if !healthy {
			return nil, errors.New("ledger service rejected the entry")
		}
		return nil, nil
	}
	msg := paymentMsg("m-poison", 1, 500)
	msg.Metadata.Set("_watermill_amqp_redelivered", "true")
	// Each delivery runs in a new Inbox, as after a restart: the count lives in the database.
	for attempt := 1; attempt <= 3; attempt++ {
		ib := e.inbox("billing", withDeadLetters(dl, 3))
		err := deliver(ib.Middleware(handler), msg)
		switch {
		case attempt < 3 && err == nil:
			t.Fatalf("attempt %d was acked; a failing message must be nacked until its last attempt", attempt)
		case attempt == 3 && err != nil:
			t.Fatalf("last attempt: %v; the dead-lettered original must be acked", err)
		}
		if n, lastErr, _ := e.attemptsRow(msg.UUID); n != attempt || !strings.Contains(lastErr, "ledger service") {
			t.Fatalf("after attempt %d: attempts row (%d, %q)", attempt, n, lastErr)
		}
	}
	got := dl.wait(t, 1)[0]
	if got.UUID != msg.UUID || string(got.Payload) != string(msg.Payload) {
		t.Fatalf("dead letter is not the original message: %s %s", got.UUID, got.Payload)
	}
	if r := got.Metadata.Get(wmmiddleware.ReasonForPoisonedKey); !strings.Contains(r, "failed 3 of 3 attempts") || !strings.Contains(r, "ledger service") {
		t.Fatalf("reason_poisoned = %q", r)
	}
	if _, ok := got.Metadata["_watermill_amqp_redelivered"]; ok {
		t.Fatal("the dead letter kept the delivery's redelivered flag")
	}
	if got.Metadata.Get(inbox.DeadLetterAttemptsKey) != "3" || got.Metadata.Get(inbox.DeadLetterConsumerKey) != "billing" || got.Metadata.Get(inbox.DeadLetterMessageKeyKey) != msg.UUID {
		t.Fatalf("dead letter metadata = %v", got.Metadata)
	}
	if _, _, dead := e.attemptsRow(msg.UUID); !dead {
		t.Fatal("dead-lettered state not recorded")
	}
	// Redelivered after dead-lettering: acked, handler not run, not processed.
	ib := e.inbox("billing", withDeadLetters(dl, 3))
	if err := deliver(ib.Middleware(handler), msg); err != nil {
		t.Fatal(err)
	}
	if r, b, n := e.runs.Load(), e.balance(1), e.rows(""); r != 3 || b != 0 || n != 0 {
		t.Fatalf("handler runs %d, balance %d, processed rows %d; want 3, 0, 0", r, b, n)
	}
	if s := ib.Stats(); s.DeadLetteredSkips != 1 || s.Processed != 0 {
		t.Fatalf("stats %+v", s)
	}
	// Replayed: the next delivery runs once more and succeeds.
	healthy = true
	if replayed, err := ib.Replay(context.Background(), msg.UUID); err != nil || !replayed {
		t.Fatalf("Replay = %v, %v", replayed, err)
	}
	for range 2 {
		if err := deliver(ib.Middleware(handler), msg); err != nil {
			t.Fatal(err)
		}
	}
	if r, b, n := e.runs.Load(), e.balance(1), e.rows(""); r != 4 || b != 500 || n != 1 {
		t.Fatalf("after replay: handler runs %d, balance %d, rows %d; want 4, 500, 1", r, b, n)
	}
	if n, _, _ := e.attemptsRow(msg.UUID); n != 0 {
		t.Fatal("the successful delivery left its attempt record behind")
	}
	dl.wait(t, 1)
}

func TestCrashedAttemptsCountTowardsTheLimit(t *testing.T) {
	e := newEnv(t, 2)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 2))
	msg := paymentMsg("m-crashy", 2, 9)
	// Two deliveries that died mid-handler (the process was killed): their attempts were
	// committed before the claim transaction began, which then vanished with the process.
	for range 2 {
		e.recordAttempt(msg.UUID, "billing", "")
	}
	if err := deliver(ib.Middleware(e.credit), msg); err != nil {
		t.Fatalf("third delivery: %v (must be dead-lettered and acked)", err)
	}
	if e.runs.Load() != 0 || e.balance(2) != 0 {
		t.Fatalf("the handler ran (%d) although the message had used up its attempts", e.runs.Load())
	}
	if r := dl.wait(t, 1)[0].Metadata.Get(wmmiddleware.ReasonForPoisonedKey); !strings.Contains(r, "2 of 2 attempts ran the handler and ended without settling") {
		t.Fatalf("reason = %q", r)
	}
}

func TestDeadLetterPublishFailureNacks(t *testing.T) {
	e := newEnv(t, 2)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 1))
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, errors.New("always fails")
	})
	msg := paymentMsg("m-dl-down", 3, 1)
	dl.down.Store(true)
	for range 2 {
		if err := deliver(h, msg); err == nil {
			t.Fatal("acked although the dead letter could not be published")
		}
	}
	if _, _, dead := e.attemptsRow(msg.UUID); dead {
		t.Fatal("marked dead-lettered although nothing was published")
	}
	dl.down.Store(false)
	if err := deliver(h, msg); err != nil {
		t.Fatalf("after the dead-letter broker recovered: %v", err)
	}
	if err := deliver(h, msg); err != nil {
		t.Fatal(err)
	}
	dl.wait(t, 1)
	time.Sleep(50 * time.Millisecond)
	dl.wait(t, 1) // exactly once
}

func TestPermanentErrorsSkipRetries(t *testing.T) {
	e := newEnv(t, 2)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 5))
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		e.runs.Add(1)
		return nil, inbox.Permanent(errors.New("unknown account"))
	})
	if err := deliver(h, paymentMsg("m-perm", 4, 1)); err != nil {
		t.Fatalf("permanent error: %v, want dead-lettered and acked on the first attempt", err)
	}
	// Invalid keys too, without any row written.
	for _, id := range []string{"", "bad\xff"} {
		if err := deliver(h, paymentMsg(id, 4, 1)); err != nil {
			t.Fatalf("invalid key %q: %v", id, err)
		}
	}
	var reasons []string
	for _, m := range dl.wait(t, 3) {
		reasons = append(reasons, m.Metadata.Get(wmmiddleware.ReasonForPoisonedKey))
	}
	all := strings.Join(reasons, "\n")
	for _, want := range []string{"unknown account", "empty", "invalid UTF-8"} {
		if !strings.Contains(all, want) {
			t.Fatalf("no dead letter with reason %q among:\n%s", want, all)
		}
	}
	if e.runs.Load() != 1 || e.rows("") != 0 {
		t.Fatalf("handler runs %d, rows %d; want 1, 0", e.runs.Load(), e.rows(""))
	}
	var attemptRows int
	_ = e.sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM inbox_processed_messages_attempts WHERE dead_lettered_at IS NOT NULL").Scan(&attemptRows)
	if attemptRows != 1 {
		t.Fatalf("dead-lettered records: %d, want 1 (invalid keys have no key to record)", attemptRows)
	}
}

func TestKeyCollision(t *testing.T) {
	for _, tc := range []struct {
		name      string
		policy    inbox.CollisionPolicy
		wantErr   bool
		wantDL    int
		wantSkips bool
	}{
		{"dead letter", inbox.CollisionDeadLetter, false, 1, false},
		{"reject", inbox.CollisionReject, true, 0, false},
		{"skip", inbox.CollisionSkip, false, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, 2)
			dl := newDeadLetters(t)
			ib := e.inbox("billing", withDeadLetters(dl, 3), func(c *inbox.Config) { c.OnKeyCollision = tc.policy })
			h := ib.Middleware(e.credit)
			if err := deliver(h, paymentMsg("order-1", 5, 100)); err != nil {
				t.Fatal(err)
			}
			err := deliver(h, paymentMsg("order-1", 6, 999)) // another producer reused the ID
			if (err != nil) != tc.wantErr || (err != nil && !errors.Is(err, inbox.ErrKeyCollision)) {
				t.Fatalf("collision: err = %v", err)
			}
			if err := deliver(h, paymentMsg("order-1", 5, 100)); err != nil {
				t.Fatalf("a true duplicate of the first message: %v", err)
			}
			if b5, b6 := e.balance(5), e.balance(6); b5 != 100 || b6 != 0 {
				t.Fatalf("balances %d, %d; the first message's effect must stand alone", b5, b6)
			}
			if s := ib.Stats(); s.Collisions != 1 || s.Duplicates != 1 || s.DeadLetteredSkips != 0 {
				t.Fatalf("stats %+v", s)
			}
			if tc.wantDL > 0 {
				if r := dl.wait(t, 1)[0].Metadata.Get(wmmiddleware.ReasonForPoisonedKey); !strings.Contains(r, "collision") {
					t.Fatalf("reason %q", r)
				}
			} else {
				time.Sleep(20 * time.Millisecond)
				dl.wait(t, 0)
			}
		})
	}
}

func TestInstantAckIsRefused(t *testing.T) {
	e := newEnv(t, 2)
	h := wmmiddleware.InstantAck(e.inbox("billing").Middleware(e.credit))
	err := deliver(h, paymentMsg("m-instant", 7, 1))
	if !errors.Is(err, inbox.ErrAckedBeforeHandler) {
		t.Fatalf("err = %v, want ErrAckedBeforeHandler", err)
	}
	if e.runs.Load() != 0 || e.rows("") != 0 {
		t.Fatal("the handler ran behind InstantAck")
	}
}

func TestLockTimeoutBehindSlowHandler(t *testing.T) {
	e := newEnv(t, 3)
	ib := e.inbox("billing", e.withLockTimeout(100*time.Millisecond))
	started := make(chan struct{})
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		out, err := e.credit(msg)
		close(started)
		time.Sleep(600 * time.Millisecond)
		return out, err
	})
	msg := paymentMsg("m-slow", 8, 60)
	first := make(chan error, 1)
	go func() { first <- deliver(h, msg) }()
	<-started
	begin := time.Now()
	if err := deliver(ib.Middleware(e.credit), msg); err == nil {
		t.Fatal("a duplicate behind a slow handler was acked before the first committed")
	}
	if waited := time.Since(begin); waited > 500*time.Millisecond {
		t.Fatalf("the lock wait lasted %v with a 100 ms lock timeout", waited)
	}
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if err := deliver(ib.Middleware(e.credit), msg); err != nil {
		t.Fatalf("redelivery after the first committed: %v", err)
	}
	if b, r := e.balance(8), e.runs.Load(); b != 60 || r != 1 {
		t.Fatalf("balance %d, handler runs %d; want 60, 1", b, r)
	}
}

// TestRetryAndPoisonQueueInEitherOrder adds Watermill's Retry and
// PoisonQueueWithFilter(IsPermanent) around the inbox in both orders: the durable count
// decides, so both end with MaxAttempts handler runs and one dead letter from the inbox.
func TestRetryAndPoisonQueueInEitherOrder(t *testing.T) {
	for _, order := range []string{"retry-outside", "poison-outside"} {
		t.Run(order, func(t *testing.T) {
			e := newEnv(t, 2)
			dl := newDeadLetters(t)
			ib := e.inbox("billing", withDeadLetters(dl, 3))
			poisonTopic := newDeadLetters(t)
			poison, err := wmmiddleware.PoisonQueueWithFilter(poisonTopic, "watermill.poison", inbox.IsPermanent)
			if err != nil {
				t.Fatal(err)
			}
			retry := wmmiddleware.Retry{MaxRetries: 5, InitialInterval: time.Millisecond}.Middleware
			h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				e.runs.Add(1)
				return nil, errors.New("always fails")
			})
			if order == "retry-outside" {
				h = retry(poison(h))
			} else {
				h = poison(retry(h))
			}
			// The router redelivers until the message is acked.
			deliveries := 0
			for ; deliveries < 10; deliveries++ {
				if err := deliver(h, paymentMsg("m-order", 9, 1)); err == nil {
					break
				}
			}
			if e.runs.Load() != 3 {
				t.Fatalf("handler runs %d, want 3 (MaxAttempts)", e.runs.Load())
			}
			dl.wait(t, 1)
			poisonTopic.wait(t, 0)
		})
	}
}
