package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
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

// TestTracerHookPairsBatched: in the batched mode (group commit) too, every delivery and phase
// the Tracer starts is ended exactly once and the handler runs in its handler phase's context,
// through a batch that succeeds and batches in which a member fails or panics (both designs).
func TestTracerHookPairsBatched(t *testing.T) {
	for _, mode := range []inbox.BatchMode{inbox.BatchOptimistic, inbox.BatchSavepoints} {
		t.Run(mode.String(), func(t *testing.T) {
			ft := &fakeTracer{open: map[string]int{}}
			store := storetest.NewMemStore()
			ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "c", MaxAttempts: 5,
				Tracer: ft, Batch: inbox.BatchConfig{Size: 4, Linger: 50 * time.Millisecond, Mode: mode}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			runs := map[string]int{}
			h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				if got := msg.Context().Value(phaseKey{}); got != "handler" {
					t.Errorf("%s: the handler's context is %v's, want the handler phase's", msg.UUID, got)
				}
				mu.Lock()
				runs[msg.UUID]++
				mu.Unlock()
				switch msg.UUID[1:] {
				case "-fail":
					return nil, errors.New("fails")
				case "-panic":
					panic("boom")
				}
				return nil, nil
			})
			wave := func(ids ...string) {
				var wg sync.WaitGroup
				for _, id := range ids {
					wg.Go(func() {
						defer func() { _ = recover() }()
						msg := message.NewMessage(id, []byte("x"))
						msg.SetContext(context.Background())
						_, _ = h(msg)
					})
				}
				wg.Wait()
			}
			wave("a-1", "a-2", "a-3", "a-4")
			wave("b-1", "b-2", "b-fail", "b-4")
			wave("c-1", "c-panic", "c-3", "c-4")
			for k, n := range ft.open {
				if n != 0 {
					t.Errorf("%s: %d started and not ended\n%v", k, n, ft.events)
				}
			}
			processed := 0
			for _, o := range ft.outcomes {
				if o == inbox.OutcomeProcessed {
					processed++
				}
			}
			if len(ft.outcomes) != 12 || processed != 10 {
				t.Errorf("outcomes %v: want 12 deliveries ended, 10 processed", ft.outcomes)
			}
			for _, id := range []string{"a-1", "b-1", "b-fail", "c-panic", "c-4"} {
				if runs[id] == 0 {
					t.Errorf("handler of %s never ran (runs %v)", id, runs)
				}
			}
			if s := ib.Stats(); s.Processed != 10 {
				t.Errorf("stats %+v: want 10 processed", s)
			}
		})
	}
}
