package inboxtrace_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/watermill-inbox/watermill-inbox/inboxtest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxtrace"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

type recorder struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (r *recorder) Publish(_ string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, msgs...)
	return nil
}
func (r *recorder) Close() error { return nil }

func newProvider() (*sdktrace.TracerProvider, *tracetest.InMemoryExporter) {
	exp := tracetest.NewInMemoryExporter()
	return sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)), exp
}

// producerMessage returns a message whose metadata carries the trace context of a producer
// span, as a traced publisher would send it, and that span's context.
func producerMessage(tp trace.TracerProvider, id, payload string) (*message.Message, trace.SpanContext) {
	ctx, span := tp.Tracer("producer").Start(context.Background(), "send payments", trace.WithSpanKind(trace.SpanKindProducer))
	defer span.End()
	msg := message.NewMessage(id, []byte(payload))
	propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(msg.Metadata))
	return msg, span.SpanContext()
}

func attr(s sdktrace.ReadOnlySpan, k attribute.Key) (attribute.Value, bool) {
	for _, kv := range s.Attributes() {
		if kv.Key == k {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

// deliverySpans returns the ended "process" spans of trace tid, in end order.
func spansOf(exp *tracetest.InMemoryExporter, tid trace.TraceID) []tracetest.SpanStub {
	var out []tracetest.SpanStub
	for _, s := range exp.GetSpans() {
		if s.SpanContext.TraceID() == tid {
			out = append(out, s)
		}
	}
	return out
}

// TestSpansPerOutcome delivers traced messages against real PostgreSQL with every outcome and
// checks the span tree: the delivery span continues the producer's trace as its child, the
// claim, handler and commit spans are children of the delivery span, the handler runs inside
// the handler span, the attributes follow the messaging conventions, the outcome attribute is
// right, and a dead letter carries the trace on.
func TestSpansPerOutcome(t *testing.T) {
	s := inboxtest.NewSchema(t, "t", 4)
	store := s.Store(t)
	s.CreateAccounts(t, 1)
	tp, exp := newProvider()
	dead := &recorder{}
	ib, err := inbox.New(inbox.Config{
		Store: store, ConsumerName: "billing", MaxAttempts: 2,
		DeadLetterPublisher: dead, DeadLetterTopic: "payments.dead",
		Tracer: inboxtrace.New(inboxtrace.Config{TracerProvider: tp, ConsumerName: "billing", System: "rabbitmq"}),
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var handlerSpans sync.Map // UUID -> span context seen in the handler
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		handlerSpans.Store(msg.UUID, trace.SpanContextFromContext(msg.Context()))
		if msg.UUID == "poison" {
			return nil, errors.New("poison payment")
		}
		tx, _ := pgstore.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 1 WHERE id = 1")
		return nil, err
	})
	deliver := func(msg *message.Message) {
		m := msg.Copy()
		m.SetContext(context.Background())
		_, _ = h(m)
	}

	cases := []struct {
		id, payload string
		deliveries  int
		outcomes    []string
	}{
		{"ok", "a", 2, []string{"processed", "duplicate"}},
		{"ok", "b", 1, []string{"dead_lettered"}}, // a key collision
		{"poison", "p", 3, []string{"failed_retryable", "dead_lettered", "dead_lettered_skip"}},
	}
	for _, c := range cases {
		exp.Reset()
		handlerSpans.Delete(c.id)
		msg, producer := producerMessage(tp, c.id, c.payload)
		for range c.deliveries {
			deliver(msg)
		}
		var deliveries []tracetest.SpanStub
		byID := map[trace.SpanID]tracetest.SpanStub{}
		for _, sp := range spansOf(exp, producer.TraceID()) {
			byID[sp.SpanContext.SpanID()] = sp
			if sp.SpanKind == trace.SpanKindConsumer {
				deliveries = append(deliveries, sp)
			}
		}
		if len(deliveries) != len(c.outcomes) {
			t.Fatalf("%s/%s: %d delivery spans in the producer's trace, want %d", c.id, c.payload, len(deliveries), len(c.outcomes))
		}
		for i, d := range deliveries {
			ro := d.Snapshot()
			if d.Parent.SpanID() != producer.SpanID() || !d.Parent.IsRemote() {
				t.Errorf("%s delivery %d: parent %v, want the producer's span %v (remote)", c.id, i, d.Parent.SpanID(), producer.SpanID())
			}
			if v, _ := attr(ro, inboxtrace.OutcomeKey); v.AsString() != c.outcomes[i] {
				t.Errorf("%s delivery %d: outcome %q, want %q", c.id, i, v.AsString(), c.outcomes[i])
			}
			for k, want := range map[attribute.Key]string{"messaging.system": "rabbitmq", "messaging.message.id": c.id,
				"messaging.consumer.group.name": "billing", "messaging.operation.type": "process"} {
				if v, _ := attr(ro, k); v.AsString() != want {
					t.Errorf("%s delivery %d: %s = %q, want %q", c.id, i, k, v.AsString(), want)
				}
			}
			var phases []string
			for _, sp := range byID {
				if sp.Parent.SpanID() == d.SpanContext.SpanID() {
					phases = append(phases, sp.Name)
				}
			}
			want := map[string][]string{
				"processed":          {"inbox claim", "inbox handler", "inbox commit"},
				"duplicate":          {"inbox claim"},
				"failed_retryable":   {"inbox claim", "inbox handler"},
				"dead_lettered_skip": {"inbox claim"},
			}[c.outcomes[i]]
			if c.outcomes[i] == "dead_lettered" && c.id == "poison" {
				want = []string{"inbox claim", "inbox handler", "inbox dead_letter"}
			} else if c.outcomes[i] == "dead_lettered" {
				want = []string{"inbox claim", "inbox dead_letter"}
			}
			if !sameSet(phases, want) {
				t.Errorf("%s delivery %d (%s): child spans %v, want %v", c.id, i, c.outcomes[i], phases, want)
			}
			failed := c.outcomes[i] == "failed_retryable" || c.outcomes[i] == "dead_lettered"
			if (d.Status.Code == codes.Error) != failed {
				t.Errorf("%s delivery %d: status %v", c.id, i, d.Status)
			}
		}
		// The handler ran inside the handler span of its delivery.
		if v, ok := handlerSpans.Load(c.id); ok {
			sc := v.(trace.SpanContext)
			hs, found := byID[sc.SpanID()]
			if !found || hs.Name != "inbox handler" {
				t.Errorf("%s: the handler's context holds span %v, not an inbox handler span", c.id, sc.SpanID())
			}
		}
	}
	// Dead letters carry the trace on: the producer's trace, the dead_letter span as parent.
	if len(dead.msgs) != 2 {
		t.Fatalf("%d dead letters, want 2", len(dead.msgs))
	}
	for _, dl := range dead.msgs {
		sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier(dl.Metadata)))
		if !sc.IsValid() {
			t.Fatalf("dead letter %s carries no trace context", dl.UUID)
		}
		var found bool
		for _, sp := range exp.GetSpans() {
			if sp.SpanContext.SpanID() == sc.SpanID() && sp.Name == "inbox dead_letter" && sp.SpanContext.TraceID() == sc.TraceID() {
				found = true
			}
		}
		if !found && dl.UUID == "poison" {
			t.Errorf("dead letter %s: trace context %v is not its dead_letter span", dl.UUID, sc)
		}
	}
	var balance int
	if err := s.Pool.QueryRow(context.Background(), "SELECT balance FROM accounts WHERE id = 1").Scan(&balance); err != nil || balance != 1 {
		t.Fatalf("balance %d (%v), want 1", balance, err)
	}
}

func sameSet(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	m := map[string]int{}
	for _, x := range a {
		m[x]++
	}
	for _, x := range b {
		m[x]--
	}
	for _, v := range m {
		if v != 0 {
			return false
		}
	}
	return true
}
