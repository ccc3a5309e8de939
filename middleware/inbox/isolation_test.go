package inbox_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// crashOverlap is a handler that credits a payment and records which handlers ran at the same
// time as the suspect's: a slow handler (slow) holds its delivery for hold.
type crashOverlap struct {
	e        *env
	suspect  string
	hold     time.Duration
	inFlight atomic.Int32
	running  atomic.Bool  // the suspect's handler is running
	overlaps atomic.Int32 // handler starts that found the suspect running, or the suspect finding others
	runs     sync.Map     // message UUID -> *atomic.Int32
}

func (c *crashOverlap) handler(msg *message.Message) ([]*message.Message, error) {
	n := c.inFlight.Add(1)
	defer c.inFlight.Add(-1)
	v, _ := c.runs.LoadOrStore(msg.UUID, new(atomic.Int32))
	v.(*atomic.Int32).Add(1)
	if msg.UUID == c.suspect {
		if n != 1 {
			c.overlaps.Add(1)
		}
		c.running.Store(true)
		defer c.running.Store(false)
		time.Sleep(50 * time.Millisecond) // long enough for a delivery let in to start
	} else {
		if c.running.Load() {
			c.overlaps.Add(1)
		}
		time.Sleep(c.hold)
	}
	return c.e.credit(msg)
}

func (c *crashOverlap) runsOf(id string) int32 {
	v, ok := c.runs.Load(id)
	if !ok {
		return 0
	}
	return v.(*atomic.Int32).Load()
}

// whileSlowRuns delivers slow through h, calls f once slow's handler runs, then waits for
// slow's delivery, which must succeed.
func (c *crashOverlap) whileSlowRuns(t *testing.T, h message.HandlerFunc, slow *message.Message, f func()) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- deliver(h, slow) }()
	for c.inFlight.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	f()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// crashedOnce records what a consumer that died while the key's handler ran leaves behind:
// one counted attempt and no recorded error.
func crashedOnce(t *testing.T, e *env, id, consumer string) {
	t.Helper()
	e.recordAttempt(id, consumer, "")
}

// TestCrashSuspectRunsAlone: a message whose earlier delivery ended unsettled (its consumer
// died with it in flight: one attempt, no error recorded) runs its handler alone among the
// Inbox's deliveries: it waits for the three slow deliveries in flight to finish, and the
// three that arrive while it waits or runs wait for it. So a crash during its run can be
// charged to it alone, never to a healthy neighbour (docs/design.md, "Crash isolation").
// Every payment is applied once, nothing is dead-lettered, no attempt row is left. With the
// broker's signal the suspect is the broker's redelivery after the crash, flagged, so it is
// counted up front and reads the record. (A first delivery reads no record, so it is never a
// suspect: TestFirstDeliveryOfASuspectKeyIsNotIsolated.)
func TestCrashSuspectRunsAlone(t *testing.T) {
	for _, sig := range signals {
		t.Run(sig.name, func(t *testing.T) {
			e := newEnv(t, 10)
			dl := newDeadLetters(t)
			var results sync.Map // message UUID -> inbox.Result
			observe := inbox.ObserverFunc(func(_ context.Context, r inbox.Result) {
				results.Store(r.MessageUUID, r)
			})
			ib := e.inbox("billing", withDeadLetters(dl, 3), sig.mod, func(c *inbox.Config) { c.Observer = observe })
			c := &crashOverlap{e: e, suspect: "m-suspect", hold: 200 * time.Millisecond}
			h := ib.Middleware(c.handler)
			crashedOnce(t, e, "m-suspect", "billing")

			var wg sync.WaitGroup
			errs := make(chan error, 7)
			send := func(id string) {
				msg := paymentMsg(id, 1, 1)
				if id == "m-suspect" {
					msg.Metadata.Set(redeliveredKey, "true")
				}
				wg.Go(func() { errs <- deliver(h, msg) })
			}
			for _, id := range []string{"m-before-1", "m-before-2", "m-before-3"} {
				send(id)
			}
			for c.inFlight.Load() != 3 {
				time.Sleep(time.Millisecond)
			}
			send("m-suspect")
			time.Sleep(20 * time.Millisecond) // the suspect claims, takes its count back and waits
			for _, id := range []string{"m-after-1", "m-after-2", "m-after-3"} {
				send(id)
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Fatal(err)
				}
			}
			if n := c.overlaps.Load(); n != 0 {
				t.Fatalf("%d handlers ran alongside the suspect's", n)
			}
			if n := c.runsOf("m-suspect"); n != 1 {
				t.Fatalf("the suspect's handler ran %d times, want 1", n)
			}
			if got := ib.Stats().Isolated; got != 1 {
				t.Fatalf("Stats().Isolated = %d, want 1", got)
			}
			results.Range(func(k, v any) bool {
				if r := v.(inbox.Result); r.Isolated != (k == "m-suspect") || r.Outcome != inbox.OutcomeProcessed {
					t.Errorf("%s: Result.Isolated %v, outcome %s", k, r.Isolated, r.Outcome)
				}
				return true
			})
			e.settled(dl, 1, 7)
		})
	}
}

// TestCrashIsolationGivesUpAfterClaimTimeout: a suspect that cannot have the Inbox to itself
// within ClaimTimeout (another delivery's handler runs longer) runs alongside it rather than
// wait on: it is applied once, not isolated, and nothing is dead-lettered.
func TestCrashIsolationGivesUpAfterClaimTimeout(t *testing.T) {
	e := newEnv(t, 6)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 3), func(c *inbox.Config) { c.ClaimTimeout = 300 * time.Millisecond })
	c := &crashOverlap{e: e, suspect: "m-suspect", hold: 1500 * time.Millisecond}
	h := ib.Middleware(c.handler)
	crashedOnce(t, e, "m-suspect", "billing")

	var took time.Duration
	c.whileSlowRuns(t, h, paymentMsg("m-slow", 2, 5), func() {
		start := time.Now()
		if err := deliver(h, paymentMsg("m-suspect", 2, 1)); err != nil {
			t.Fatal(err)
		}
		took = time.Since(start)
	})
	if took > time.Second {
		t.Fatalf("the suspect waited %s: it should give up isolation after ClaimTimeout (300ms)", took)
	}
	if c.overlaps.Load() == 0 {
		t.Fatal("the suspect did not run alongside the slow delivery")
	}
	if got := ib.Stats().Isolated; got != 0 {
		t.Fatalf("Stats().Isolated = %d, want 0", got)
	}
	e.settled(dl, 2, 6)
}

// TestCrashIsolationOnlyForUnsettledAttempts: a message whose earlier attempt failed with an
// error it recorded (a nack after a handler error, not a crash) is no suspect: it runs
// alongside others, so an outage that fails every message does not make the recovery run
// one message at a time.
func TestCrashIsolationOnlyForUnsettledAttempts(t *testing.T) {
	e := newEnv(t, 6)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 3))
	c := &crashOverlap{e: e, suspect: "m-failed-before", hold: 300 * time.Millisecond}
	h := ib.Middleware(c.handler)
	e.recordAttempt("m-failed-before", "billing", "downstream unavailable")
	c.whileSlowRuns(t, h, paymentMsg("m-slow", 3, 5), func() {
		if err := deliver(h, paymentMsg("m-failed-before", 3, 1)); err != nil {
			t.Fatal(err)
		}
	})
	if c.overlaps.Load() == 0 {
		t.Fatal("the message with a recorded failure waited to run alone")
	}
	if got := ib.Stats().Isolated; got != 0 {
		t.Fatalf("Stats().Isolated = %d, want 0", got)
	}
	e.settled(dl, 3, 6)
}
