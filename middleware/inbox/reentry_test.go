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

// purgeExpired runs pgstore's PurgeExpired on e's tables with a 14-day retention window.
func (e *env) purgeExpired() (pgstore.PurgeReport, error) {
	e.t.Helper()
	s, err := pgstore.New(e.sch.Pool, pgstore.Config{Schema: e.sch.Name, Retention: inbox.Retention{Window: 14 * 24 * time.Hour}})
	if err != nil {
		e.t.Fatal(err)
	}
	return s.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{})
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

// TestResentDeadLetteredKeyIsSkippedWhateverTheWrapping: a copy of a dead-lettered message the
// producer sent again, as a first delivery, is skipped and acked without running the handler,
// whether the inbox runs alone, under Watermill's Retry (with and without ResetContextOnRetry)
// or under the canonical PoisonQueueWithFilter(IsPermanent): no second dead letter on either
// topic, the record unchanged.
func TestResentDeadLetteredKeyIsSkippedWhateverTheWrapping(t *testing.T) {
	wrappings := map[string]func(t *testing.T, h message.HandlerFunc) message.HandlerFunc{
		"alone": func(_ *testing.T, h message.HandlerFunc) message.HandlerFunc { return h },
		"retry": func(_ *testing.T, h message.HandlerFunc) message.HandlerFunc {
			return wmmiddleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware(h)
		},
		"retry-reset-context": func(_ *testing.T, h message.HandlerFunc) message.HandlerFunc {
			return wmmiddleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, ResetContextOnRetry: true}.Middleware(h)
		},
		"poison-queue": func(t *testing.T, h message.HandlerFunc) message.HandlerFunc {
			poison, err := wmmiddleware.PoisonQueueWithFilter(newDeadLetters(t), "poison", inbox.IsPermanent)
			if err != nil {
				t.Fatal(err)
			}
			return poison(h)
		},
	}
	for name, wrap := range wrappings {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, 4)
			dl := newDeadLetters(t)
			ib := e.inbox("billing", withDeadLetters(dl, 1), func(c *inbox.Config) { c.Redelivery = redeliveryFromFlag })
			inner := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				if _, err := e.credit(msg); err != nil {
					return nil, err
				}
				return nil, inbox.Permanent(errors.New("payment rejected"))
			})
			msg := paymentMsg("m-resent-"+name, 3, 1)
			if err := deliver(inner, msg); err != nil { // dead-lettered at once
				t.Fatal(err)
			}
			dl.wait(t, 1)
			before, _, _ := e.attemptsRow(msg.UUID)
			if err := deliver(wrap(t, inner), msg); err != nil {
				t.Fatalf("the resent copy: %v, want it skipped and acked", err)
			}
			time.Sleep(50 * time.Millisecond)
			dl.wait(t, 1)
			if r, s := e.runs.Load(), ib.Stats(); r != 1 || s.DeadLetteredSkips != 1 || e.balance(3) != 0 {
				t.Fatalf("handler runs %d, stats %+v, balance %d; want 1 run (the first), 1 skip, balance 0", r, s, e.balance(3))
			}
			if n, _, dead := e.attemptsRow(msg.UUID); !dead || n != before {
				t.Fatalf("record: attempts %d (was %d), dead-lettered %v", n, before, dead)
			}
		})
	}
}
