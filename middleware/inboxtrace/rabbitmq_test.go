package inboxtrace_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"

	adamqp "github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxtrace"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
)

// TestTraceThroughRabbitMQAndOutbox: a producer publishes a traced payment to a real RabbitMQ;
// the billing inbox processes it and its handler returns a receipt, stored in the outbox in
// the inbox transaction; the relay publishes the receipt to RabbitMQ; the ledger inbox
// processes it. Both delivery spans are in the producer's trace: billing's is the producer
// span's child, ledger's the child of billing's handler span (the context the outbox carried).
func TestTraceThroughRabbitMQAndOutbox(t *testing.T) {
	url := testenv.RequireAMQP(t)
	s := testenv.NewSchema(t, 6)
	store := s.Store(t)
	ctx := context.Background()
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	payments, receipts := "trace_pay_"+hex.EncodeToString(rnd[:]), "trace_receipts_"+hex.EncodeToString(rnd[:])

	b, err := adamqp.New(adamqp.Config{URL: url, Prefetch: 1, DeclareGroups: []string{""},
		QueueArguments: map[string]any{"x-expires": int32(10 * 60 * 1000)}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })

	ocfg := outbox.Config{Schema: s.Name}
	if err := outbox.InitializeSchema(ctx, s.Pool, ocfg); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(ocfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	tp, exp := newProvider()
	billing, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing", Outbox: ob,
		Tracer: inboxtrace.New(inboxtrace.Config{TracerProvider: tp, ConsumerName: "billing", System: "rabbitmq"})}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ledger, err := inbox.New(inbox.Config{Store: store, ConsumerName: "ledger",
		Tracer: inboxtrace.New(inboxtrace.Config{TracerProvider: tp, ConsumerName: "ledger", System: "rabbitmq"})}, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 1)
	router, err := message.NewRouter(message.RouterConfig{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	router.AddHandler("billing", payments, b.Subscriber, receipts, b.Publisher,
		billing.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage("receipt-"+msg.UUID, []byte("receipt"))}, nil
		}))
	ledgerHandler := ledger.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		got <- msg.UUID
		return nil, nil
	})
	router.AddConsumerHandler("ledger", receipts, b.Subscriber, func(msg *message.Message) error {
		_, err := ledgerHandler(msg)
		return err
	})
	testenv.RunRouter(t, router)
	relay, err := outbox.NewRelay(outbox.RelayConfig{Config: ocfg, Pool: s.Pool, Publisher: b.Publisher, PollInterval: 20 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = relay.Run(ctx) }()
	t.Cleanup(func() { _ = relay.Close() })

	msg, producer := producerMessage(tp, "pay-1", "10")
	if err := b.Publisher.Publish(payments, msg); err != nil {
		t.Fatal(err)
	}
	select {
	case id := <-got:
		if id != "receipt-pay-1" {
			t.Fatalf("ledger got %q", id)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the receipt did not reach the ledger consumer through the outbox and RabbitMQ within 30 s")
	}
	// The ledger's delivery span ends right after its handler returns.
	var billingSpan, billingHandler, ledgerSpan *trace.SpanContext
	var billingParent, ledgerParent trace.SpanContext
	deadline := time.Now().Add(5 * time.Second)
	for ledgerSpan == nil && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		for _, sp := range exp.GetSpans() {
			sc := sp.SpanContext
			switch sp.Name {
			case "process " + payments:
				billingSpan, billingParent = &sc, sp.Parent
			case "process " + receipts:
				ledgerSpan, ledgerParent = &sc, sp.Parent
			}
		}
	}
	for _, sp := range exp.GetSpans() {
		if sp.Name == "inbox handler" && billingSpan != nil && sp.Parent.SpanID() == billingSpan.SpanID() {
			sc := sp.SpanContext
			billingHandler = &sc
		}
	}
	if billingSpan == nil || ledgerSpan == nil || billingHandler == nil {
		t.Fatalf("spans missing: billing %v, billing handler %v, ledger %v", billingSpan, billingHandler, ledgerSpan)
	}
	if billingSpan.TraceID() != producer.TraceID() || billingParent.SpanID() != producer.SpanID() {
		t.Errorf("billing delivery span %v (parent %v) does not continue the producer's span %v through RabbitMQ", billingSpan, billingParent.SpanID(), producer)
	}
	if ledgerSpan.TraceID() != producer.TraceID() || ledgerParent.SpanID() != billingHandler.SpanID() {
		t.Errorf("ledger delivery span %v (parent %v) does not continue billing's handler span %v through the outbox", ledgerSpan, ledgerParent.SpanID(), billingHandler.SpanID())
	}
	var rows int
	if err := s.Pool.QueryRow(ctx, "SELECT count(*) FROM "+store.Table()+" WHERE message_id IN ('pay-1', 'receipt-pay-1')").Scan(&rows); err != nil || rows != 2 {
		t.Fatalf("%d inbox rows (%v), want 2: each consumer processed its message once", rows, err)
	}
}
