package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/storetest"
)

type phaseKey struct{}

// fakeTracer records the Tracer calls; each started delivery and phase must end exactly once.
type fakeTracer struct {
	mu       sync.Mutex
	open     map[string]int // "delivery" or phase name -> started minus ended
	events   []string
	outcomes []inbox.Outcome
	injected int
}

func (f *fakeTracer) add(k string, d int, ev string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.open[k] += d
	f.events = append(f.events, ev)
}

func (f *fakeTracer) StartDelivery(ctx context.Context, msg *message.Message) (context.Context, func(inbox.Result)) {
	f.add("delivery", 1, "start "+msg.UUID)
	ended := false
	return context.WithValue(ctx, phaseKey{}, "delivery"), func(r inbox.Result) {
		if ended {
			panic("delivery ended twice")
		}
		ended = true
		f.mu.Lock()
		f.outcomes = append(f.outcomes, r.Outcome)
		f.mu.Unlock()
		f.add("delivery", -1, "end "+r.Outcome.String())
	}
}

func (f *fakeTracer) StartPhase(ctx context.Context, p inbox.Phase) (context.Context, func(error)) {
	if ctx.Value(phaseKey{}) != "delivery" {
		panic(fmt.Sprintf("phase %s did not get the delivery's context", p))
	}
	f.add(p.String(), 1, "start "+p.String())
	ended := false
	return context.WithValue(ctx, phaseKey{}, p.String()), func(error) {
		if ended {
			panic("phase ended twice")
		}
		ended = true
		f.add(p.String(), -1, "end "+p.String())
	}
}

func (f *fakeTracer) Inject(ctx context.Context, p inbox.Phase, md message.Metadata) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.injected++
	md.Set("trace", fmt.Sprint(ctx.Value(phaseKey{})))
}

// TestTracerHookPairs: every delivery and phase the Tracer hook starts is ended exactly once,
// through a success, a duplicate, a transaction retry, a handler panic and a dead letter; the
// handler runs in the handler phase's context; dead letters get the dead-letter phase's trace.
func TestTracerHookPairs(t *testing.T) {
	ft := &fakeTracer{open: map[string]int{}}
	dead := &recordingPublisher{}
	ib, err := inbox.New(inbox.Config{Store: storetest.NewMemStore(), ConsumerName: "c", MaxAttempts: 2,
		DeadLetterPublisher: dead, DeadLetterTopic: "dead", Tracer: ft}, nil)
	if err != nil {
		t.Fatal(err)
	}
	conflicted := false
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if got := msg.Context().Value(phaseKey{}); got != "handler" {
			t.Errorf("the handler's context is %v's, want the handler phase's", got)
		}
		switch msg.UUID {
		case "conflict":
			if !conflicted {
				conflicted = true
				return nil, storetest.ErrConflict
			}
		case "panic":
			panic("boom")
		case "poison":
			return nil, errors.New("poison")
		}
		return nil, nil
	})
	deliver := func(id string) {
		defer func() { _ = recover() }()
		msg := message.NewMessage(id, []byte("x"))
		msg.SetContext(context.Background())
		_, _ = h(msg)
	}
	for _, id := range []string{"ok", "ok", "conflict", "panic", "poison", "poison", "poison"} {
		deliver(id)
	}
	for k, n := range ft.open {
		if n != 0 {
			t.Errorf("%s: %d started and not ended\n%v", k, n, ft.events)
		}
	}
	want := []inbox.Outcome{inbox.OutcomeProcessed, inbox.OutcomeDuplicate, inbox.OutcomeProcessed, inbox.OutcomeFailedRetryable,
		inbox.OutcomeFailedRetryable, inbox.OutcomeDeadLettered, inbox.OutcomeDeadLetteredSkip}
	if fmt.Sprint(ft.outcomes) != fmt.Sprint(want) {
		t.Errorf("outcomes %v, want %v", ft.outcomes, want)
	}
	if len(dead.msgs) != 1 || dead.msgs[0].Metadata.Get("trace") != "dead_letter" || ft.injected != 1 {
		t.Errorf("dead letters %d, injected %d: want one, with the dead-letter phase's trace context", len(dead.msgs), ft.injected)
	}
}

type recordingPublisher struct{ msgs []*message.Message }

func (p *recordingPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.msgs = append(p.msgs, msgs...)
	return nil
}
func (p *recordingPublisher) Close() error { return nil }
