package middleware_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	inbox "github.com/watermill-inbox/watermill-inbox/middleware"
)

// TestRouterAcksDuplicatesAndRoutesPermanentErrors runs the inbox in a Watermill router on
// GoChannel, whose Publish returns only once the subscriber acked (a nack is redelivered and
// Publish keeps waiting). A duplicate is acked without running the handler; an invalid key is
// a permanent error that Watermill's PoisonQueueWithFilter(IsPermanent), added outside the
// inbox, routes to a poison topic and acks.
func TestRouterAcksDuplicatesAndRoutesPermanentErrors(t *testing.T) {
	e := newEnv(t, 3)
	ib := e.inbox("billing")
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	poison, err := wmmiddleware.PoisonQueueWithFilter(pubsub, "payments.poison", inbox.IsPermanent)
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(poison, ib.Middleware) // poison queue outside, inbox innermost
	router.AddConsumerHandler("billing", "payments", pubsub, func(msg *message.Message) error {
		_, err := e.credit(msg)
		return err
	})
	poisoned, err := pubsub.Subscribe(context.Background(), "payments.poison")
	if err != nil {
		t.Fatal(err)
	}
	// The poison publish also waits for an ack, so drain the poison topic concurrently.
	gotPoison := make(chan *message.Message, 1)
	go func() {
		for m := range poisoned {
			m.Ack()
			gotPoison <- m
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()

	publish := func(m *message.Message) {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- pubsub.Publish("payments", m) }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("message %q was never acked", m.UUID)
		}
	}
	publish(paymentMsg("pay-1", 1, 10))
	publish(paymentMsg("pay-1", 1, 10)) // redelivered duplicate
	publish(paymentMsg("pay-2", 1, 5))
	publish(paymentMsg("", 1, 1000)) // a producer that sent no ID

	select {
	case m := <-gotPoison:
		if m.Metadata.Get(wmmiddleware.ReasonForPoisonedKey) == "" || m.Metadata.Get(wmmiddleware.PoisonedHandlerKey) != "billing" {
			t.Fatalf("poisoned message metadata = %v", m.Metadata)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the message without an ID never reached the poison topic")
	}
	if b, n, r := e.balance(1), e.rows(""), e.runs.Load(); b != 15 || n != 2 || r != 2 {
		t.Fatalf("balance %d, rows %d, handler runs %d; want 15, 2, 2", b, n, r)
	}
	if s := ib.Stats(); s.Processed != 2 || s.Duplicates != 1 || s.InvalidKeys != 1 {
		t.Fatalf("stats %+v", s)
	}
}
