package inbox_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// Found by a review of CountedClaimParams.NoRecord (a first delivery claimed without reading
// the key's attempt record); each test failed before its fix.

// TestOuterRetryOfAFirstDeliveryReadsTheRecord: Retry outside the inbox (the documented order)
// calls it again with the same message, whose broker signal still says first delivery. The
// re-entry reads the record the failed try left, so the try that succeeds clears it: no
// attempt row is left. Retry's own in-process retries, at each isolation level.
func TestOuterRetryOfAFirstDeliveryReadsTheRecord(t *testing.T) {
	for _, fails := range []int{1, 2} {
		e := newEnv(t, 4)
		dl := newDeadLetters(t)
		ib := e.inbox("billing", withDeadLetters(dl, 3), func(c *inbox.Config) { c.Redelivery = redeliveryFromFlag })
		var tries atomic.Int32
		h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			if tries.Add(1) <= int32(fails) {
				return nil, errors.New("ledger briefly unavailable")
			}
			return e.credit(msg)
		})
		h = wmmiddleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware(h)
		if err := deliver(h, paymentMsg("m-retry", 2, 5)); err != nil {
			t.Fatal(err)
		}
		if n, le, _ := e.attemptsRow("m-retry"); n != 0 {
			t.Fatalf("%d failures: attempt row left with %d attempts, last error %q", fails, n, le)
		}
		e.settled(dl, 2, 5)
	}
}

// TestResentDeadLetteredKeyIsNotPoisonedTwice: a copy of a dead-lettered message that the
// producer sent again fails permanently on its first delivery; the inbox nacks it with an
// error that is not permanent, so the canonical PoisonQueueWithFilter(IsPermanent) outside
// does not publish it a second time; its redelivery is skipped.
func TestResentDeadLetteredKeyIsNotPoisonedTwice(t *testing.T) {
	e := newEnv(t, 4)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 3), func(c *inbox.Config) { c.Redelivery = redeliveryFromFlag })
	inner := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		e.runs.Add(1)
		return nil, inbox.Permanent(errors.New("payment rejected"))
	})
	msg := paymentMsg("m-perm", 3, 1)
	if err := deliver(inner, msg); err != nil { // dead-lettered at once
		t.Fatal(err)
	}
	dl.wait(t, 1)
	poisonTopic := newDeadLetters(t)
	poison, err := wmmiddleware.PoisonQueueWithFilter(poisonTopic, dlTopic, inbox.IsPermanent)
	if err != nil {
		t.Fatal(err)
	}
	h := poison(inner)
	if err := deliver(h, msg); err == nil || inbox.IsPermanent(err) {
		t.Fatalf("a permanent failure of a resent dead-lettered message: %v, want a nack that is not permanent", err)
	}
	redelivered := msg.Copy()
	redelivered.Metadata.Set(redeliveredKey, "true")
	if err := deliver(h, redelivered); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	poisonTopic.wait(t, 0)
	dl.wait(t, 1)
	if r, s := e.runs.Load(), ib.Stats(); r != 2 || s.DeadLetteredSkips != 1 {
		t.Fatalf("handler runs %d, stats %+v; want 2 runs and 1 dead-lettered skip", r, s)
	}
}

// TestOuterRetryRunsAResentDeadLetteredKeyOnce: with Retry outside, a resent dead-lettered
// message runs its handler once; Retry's next call is a re-entry, reads the record and is
// skipped (acked).
func TestOuterRetryRunsAResentDeadLetteredKeyOnce(t *testing.T) {
	e := newEnv(t, 4)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 1), func(c *inbox.Config) { c.Redelivery = redeliveryFromFlag })
	inner := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := e.credit(msg); err != nil { // counts the run
			return nil, err
		}
		return nil, errors.New("downstream timeout")
	})
	msg := paymentMsg("m-dl-retry", 3, 1)
	if err := deliver(inner, msg); err != nil { // MaxAttempts 1: dead-lettered
		t.Fatal(err)
	}
	dl.wait(t, 1)
	e.runs.Store(0)
	h := wmmiddleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware(inner)
	if err := deliver(h, msg); err != nil {
		t.Fatalf("the re-entry of a resent dead-lettered message: %v, want it skipped and acked", err)
	}
	if r, s := e.runs.Load(), ib.Stats(); r != 1 || s.DeadLetteredSkips != 1 || e.balance(3) != 0 {
		t.Fatalf("handler runs %d, stats %+v, balance %d; want 1 run, 1 skip, balance 0", r, s, e.balance(3))
	}
	dl.wait(t, 1)
}

// TestBatchedModeReadsTheRecordOfFirstDeliveries: the batched mode reads the attempt record
// for every delivery, also one that runs alone (a batch of one takes the immediate path): a
// resent dead-lettered message is skipped there.
func TestBatchedModeReadsTheRecordOfFirstDeliveries(t *testing.T) {
	e := newEnv(t, 4)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 1), withBatch(4, inbox.BatchOptimistic), func(c *inbox.Config) {
		c.Redelivery = redeliveryFromFlag
		c.Batch.Linger = 5 * time.Millisecond
	})
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		e.runs.Add(1)
		return nil, errors.New("downstream timeout")
	})
	msg := paymentMsg("m-batch-dl", 3, 1)
	_ = deliver(h, msg)
	dl.wait(t, 1)
	e.runs.Store(0)
	if err := deliver(h, msg); err != nil {
		t.Fatal(err)
	}
	if r, s := e.runs.Load(), ib.Stats(); r != 0 || s.DeadLetteredSkips != 1 {
		t.Fatalf("batched mode: the resend of a dead-lettered message ran the handler %d times (stats %+v), want 0 and a skip", r, s)
	}
}

// capturePub keeps what is published to it.
type capturePub struct {
	mu  sync.Mutex
	got []*message.Message
}

func (p *capturePub) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.got = append(p.got, msgs...)
	return nil
}

func (p *capturePub) Close() error { return nil }

// TestNoReplayOfADeadLetterProcessedSince: a dead-lettered payment whose copy the producer
// sent again is applied by that copy's first delivery. Its dead letter is then moot, and
// replaying it must not apply the payment a second time, whenever the operator replays it:
// before the inbox row is purged (ReplayDeadLetter refuses: ErrNotDeadLettered), or after it
// was purged with Purge (the Purger) or PurgeExpired (the moot record went with the row).
func TestNoReplayOfADeadLetterProcessedSince(t *testing.T) {
	for _, when := range []string{"before-purge", "after-purge", "after-purge-expired"} {
		t.Run(when, func(t *testing.T) {
			e := newEnv(t, 4)
			dl := newDeadLetters(t)
			ib := e.inbox("billing", withDeadLetters(dl, 1), func(c *inbox.Config) { c.Redelivery = redeliveryFromFlag })
			var healthy atomic.Bool
			h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				if !healthy.Load() {
					return nil, errors.New("ledger down")
				}
				return e.credit(msg)
			})
			msg := paymentMsg("m-late-replay", 5, 6)
			if err := deliver(h, msg); err != nil { // MaxAttempts 1: dead-lettered
				t.Fatal(err)
			}
			dead := dl.wait(t, 1)[0]
			healthy.Store(true)
			if err := deliver(h, msg); err != nil { // the producer's resend: applied
				t.Fatal(err)
			}
			if b := e.balance(5); b != 6 {
				t.Fatalf("balance %d after the resend, want 6", b)
			}
			switch when {
			case "after-purge":
				if _, err := e.store.Purge(context.Background(), inbox.PurgeParams{Before: time.Now().Add(time.Hour)}); err != nil {
					t.Fatal(err)
				}
			case "after-purge-expired":
				e.exec("UPDATE inbox_processed_messages SET received_at = now() - interval '30 days'")
				if _, err := e.purgeExpired(); err != nil {
					t.Fatal(err)
				}
			}
			if when != "before-purge" {
				if e.rows("") != 0 || e.attemptRows() != 0 {
					t.Fatalf("after the purge: %d inbox rows, %d attempt rows; want none (the moot dead letter goes with its row)", e.rows(""), e.attemptRows())
				}
			}
			dead.Metadata.Set(wmmiddleware.PoisonedTopicKey, "payments")
			pub := &capturePub{}
			if err := ib.ReplayDeadLetter(context.Background(), dead, pub); !errors.Is(err, inbox.ErrNotDeadLettered) {
				t.Fatalf("ReplayDeadLetter of a dead letter processed since: %v, want ErrNotDeadLettered", err)
			}
			if len(pub.got) != 0 || e.balance(5) != 6 || e.attemptRows() != 0 {
				t.Fatalf("republished %d, balance %d, attempt rows %d; want nothing republished, 6, 0", len(pub.got), e.balance(5), e.attemptRows())
			}
		})
	}
}

// purgeExpired runs pgstore's PurgeExpired on e's tables with a 14-day retention window.
func (e *env) purgeExpired() (pgstore.PurgeReport, error) {
	e.t.Helper()
	s, err := pgstore.New(e.sch.Pool, pgstore.Config{Schema: e.sch.Name, Retention: inbox.Retention{Window: 14 * 24 * time.Hour}})
	if err != nil {
		e.t.Fatal(err)
	}
	return s.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{})
}

// TestResentDeadLetteredKeyWhoseFailCannotBeRecorded: a first delivery reads no record, so when
// recording its failure fails (its connection is gone before the rollback), the inbox cannot
// tell what the record says: it nacks rather than guess, so a resent copy of a dead-lettered
// message that fails permanently is not dead-lettered a second time; its redelivery reads the
// record and is skipped.
func TestResentDeadLetteredKeyWhoseFailCannotBeRecorded(t *testing.T) {
	e := newEnv(t, 4)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 1), func(c *inbox.Config) { c.Redelivery = redeliveryFromFlag })
	var kill atomic.Bool
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if kill.Load() {
			tx, _ := pgstore.TxFromContext(msg.Context())
			var pid int32
			if err := tx.QueryRow(msg.Context(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
				return nil, err
			}
			if _, err := e.sch.Pool.Exec(context.Background(), "SELECT pg_terminate_backend($1)", pid); err != nil {
				return nil, err
			}
		}
		return nil, inbox.Permanent(errors.New("payment rejected"))
	})
	msg := paymentMsg("m-fail-unrecorded", 3, 1)
	if err := deliver(h, msg); err != nil { // dead-lettered at once
		t.Fatal(err)
	}
	dl.wait(t, 1)
	kill.Store(true)
	if err := deliver(h, msg); err == nil || inbox.IsPermanent(err) {
		t.Fatalf("a resend whose failure could not be recorded: %v, want a nack that is not permanent", err)
	}
	time.Sleep(50 * time.Millisecond)
	dl.wait(t, 1)
	kill.Store(false)
	redelivered := msg.Copy()
	redelivered.Metadata.Set(redeliveredKey, "true")
	if err := deliver(h, redelivered); err != nil {
		t.Fatal(err)
	}
	if s := ib.Stats(); s.DeadLettered != 1 || s.DeadLetteredSkips != 1 {
		t.Fatalf("stats %+v; want 1 dead letter and 1 skip", s)
	}
}

// TestCanonicalRetryResetContextReadsTheRecord: the documented Retry{ResetContextOnRetry: true}
// restores the context from before the inbox's first call on every retry; the re-entry is still
// known (by the message object) and reads the record, so the try that succeeds clears it.
func TestCanonicalRetryResetContextReadsTheRecord(t *testing.T) {
	e := newEnv(t, 4)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 3), func(c *inbox.Config) { c.Redelivery = redeliveryFromFlag })
	var tries atomic.Int32
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if tries.Add(1) == 1 {
			return nil, errors.New("ledger briefly unavailable")
		}
		return e.credit(msg)
	})
	h = wmmiddleware.Timeout(time.Second)(h)
	h = wmmiddleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware(h)
	if err := deliver(h, paymentMsg("m-reset", 2, 5)); err != nil {
		t.Fatal(err)
	}
	if n, le, _ := e.attemptsRow("m-reset"); n != 0 {
		t.Fatalf("attempt row left with %d attempts, last error %q after the message was processed", n, le)
	}
	e.settled(dl, 2, 5)
}

// TestCanonicalRetryResetContextSkipsAResentDeadLetter: with the documented Retry, a resent
// dead-lettered message runs its handler once; the re-entry reads the record and is skipped.
func TestCanonicalRetryResetContextSkipsAResentDeadLetter(t *testing.T) {
	e := newEnv(t, 4)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 1), func(c *inbox.Config) { c.Redelivery = redeliveryFromFlag })
	inner := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		e.runs.Add(1)
		return nil, errors.New("downstream timeout")
	})
	if err := deliver(inner, paymentMsg("m-dl-reset", 3, 1)); err != nil { // MaxAttempts 1: dead-lettered
		t.Fatal(err)
	}
	dl.wait(t, 1)
	e.runs.Store(0)
	h := wmmiddleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware(inner)
	err := deliver(h, paymentMsg("m-dl-reset", 3, 1))
	if r, s := e.runs.Load(), ib.Stats(); r != 1 || s.DeadLetteredSkips != 1 || err != nil {
		t.Fatalf("handler runs %d, stats %+v, err %v; want 1 run, 1 skip, acked", r, s, err)
	}
}
