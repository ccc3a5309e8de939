package inbox_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// TestCrashSuspectWaitingForAnotherDeliveryIsNotStalled: a suspect's handler that waits for
// another delivery of the same Inbox (an ordering dependency: "shipped" waits until "created"
// is applied) holds the whole gate while it runs alone, so the delivery it waits for queues at
// the gate and never runs: a stall bounded by nothing the inbox controls (here the handler's
// own 5 s patience), where docs/design.md promises ClaimTimeout bounds the waits ("a handler
// that waits for another delivery of the same Inbox"). Before crash isolation this worked.
func TestCrashSuspectWaitingForAnotherDeliveryIsNotStalled(t *testing.T) {
	e := newEnv(t, 6)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 3), func(c *inbox.Config) { c.ClaimTimeout = 300 * time.Millisecond })
	crashedOnce(t, e, "m-suspect", "billing")
	otherRan := make(chan struct{})
	suspectRunning := make(chan struct{})
	var suspectOnce sync.Once
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if msg.UUID == "m-suspect" {
			suspectOnce.Do(func() { close(suspectRunning) })
			select {
			case <-otherRan:
			case <-time.After(5 * time.Second):
				return nil, errors.New("the delivery this handler waits for never ran")
			}
		} else {
			close(otherRan)
		}
		return e.credit(msg)
	})
	var wg sync.WaitGroup
	var suspectErr error
	wg.Go(func() { suspectErr = deliver(h, paymentMsg("m-suspect", 4, 1)) })
	<-suspectRunning
	start := time.Now()
	otherErr := deliver(h, paymentMsg("m-other", 4, 1))
	took := time.Since(start)
	wg.Wait()
	if suspectErr != nil || otherErr != nil {
		t.Fatalf("suspect: %v; other: %v (the other waited %s)", suspectErr, otherErr, took.Round(time.Millisecond))
	}
	if took > 2*time.Second {
		t.Fatalf("the other delivery waited %s at the gate (ClaimTimeout 300ms)", took.Round(time.Millisecond))
	}
	if b := e.balance(4); b != 2 {
		t.Fatalf("balance %d, want 2", b)
	}
}

// TestCrashIsolatedCountsHandlerRuns: two copies of a suspect message delivered at once both
// wait to run alone; the second, once alone, finds the key processed (a duplicate) and runs no
// handler. Stats.Isolated is documented as the deliveries "that ran their handler alone": 1.
func TestCrashIsolatedCountsHandlerRuns(t *testing.T) {
	e := newEnv(t, 6)
	dl := newDeadLetters(t)
	bs := newBarrierStore(e.store, 2)
	ib := e.inbox("billing", withDeadLetters(dl, 3), func(c *inbox.Config) { c.Store = bs })
	crashedOnce(t, e, "m-suspect", "billing")
	h := ib.Middleware(e.credit)
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for range 2 {
		wg.Go(func() { errs <- deliver(h, paymentMsg("m-suspect", 6, 1)) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if r := e.runs.Load(); r != 1 {
		t.Fatalf("handler ran %d times, want 1", r)
	}
	st := ib.Stats()
	if st.Duplicates != 1 {
		t.Fatalf("Duplicates = %d, want 1", st.Duplicates)
	}
	if st.Isolated != 1 {
		t.Fatalf("Stats().Isolated = %d with one handler run", st.Isolated)
	}
}

// infoLines is a watermill logger that keeps the INFO messages it is given.
type infoLines struct {
	watermill.NopLogger
	mu    sync.Mutex
	lines []string
}

func (l *infoLines) Info(msg string, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, msg)
}

func (l *infoLines) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *infoLines) contains(part string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if strings.Contains(line, part) {
			return true
		}
	}
	return false
}

// TestSuspectWhoseDeadlinePassesAtTheGate: a suspect whose context has a deadline (a Timeout
// middleware in front of the inbox) that passes while it waits for the Inbox to empty is
// nacked without using an attempt, and the log says its deadline passed, not that the
// consumer is shutting down. Its redelivery is applied once.
func TestSuspectWhoseDeadlinePassesAtTheGate(t *testing.T) {
	e := newEnv(t, 6)
	dl := newDeadLetters(t)
	logs := &infoLines{}
	ib, err := inbox.New(inbox.Config{Store: e.store, ConsumerName: "billing", DeadLetterPublisher: dl, DeadLetterTopic: dlTopic, MaxAttempts: 3}, logs)
	if err != nil {
		t.Fatal(err)
	}
	c := &crashOverlap{e: e, suspect: "m-suspect", hold: 600 * time.Millisecond}
	h := ib.Middleware(c.handler)
	crashedOnce(t, e, "m-suspect", "billing")

	c.whileSlowRuns(t, h, paymentMsg("m-slow", 2, 5), func() {
		ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
		defer cancel()
		m := paymentMsg("m-suspect", 2, 1)
		m.SetContext(ctx)
		if _, err := h(m); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("suspect past its deadline: %v, want a nack with context.DeadlineExceeded", err)
		}
	})
	if n, _, _ := e.attemptsRow("m-suspect"); n != 1 {
		t.Fatalf("the suspect's record holds %d attempts after its abandoned delivery, want 1 (the crash only)", n)
	}
	if !logs.contains("deadline passed") || logs.contains("shutting down") {
		t.Fatalf("log lines %q: want the deadline named, not a shutdown", logs.lines)
	}
	if err := deliver(h, paymentMsg("m-suspect", 2, 1)); err != nil {
		t.Fatal(err)
	}
	e.settled(dl, 2, 6)
}
