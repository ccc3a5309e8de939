package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
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

// TestRetryOutsideInboxOpensFreshTransactions puts Watermill's in-process Retry outside the
// inbox. The first attempt breaks its transaction (a failing statement aborts it); the retry
// must run in a fresh transaction with a fresh claim, not in the aborted one.
func TestRetryOutsideInboxOpensFreshTransactions(t *testing.T) {
	e := newEnv(t, 2)
	ib := e.inbox("billing")
	retry := wmmiddleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}
	attempts := 0
	h := retry.Middleware(ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		attempts++
		if _, err := e.credit(msg); err != nil {
			return nil, err
		}
		if attempts == 1 {
			tx, _ := pgstore.TxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), "SELECT 1/0") // aborts this transaction (22012)
			return nil, err
		}
		return nil, nil
	}))
	if err := deliver(h, paymentMsg("m-retry", 2, 40)); err != nil {
		t.Fatalf("delivery with an in-process retry: %v", err)
	}
	if b, n := e.balance(2), e.rows(""); b != 40 || n != 1 || attempts != 2 {
		t.Fatalf("balance %d, rows %d, attempts %d; want 40, 1, 2", b, n, attempts)
	}
}
