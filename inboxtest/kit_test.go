package inboxtest_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/inboxtest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestKit: a user's handler that credits an account and returns an event, tested without a
// router: delivered 3 times in a row and 8 times at once, it is applied once and stores one
// event in the outbox.
func TestKit(t *testing.T) {
	sch := inboxtest.NewSchema(t, "t", 12)
	store := sch.Store(t)
	sch.CreateAccounts(t, 1)
	ctx := context.Background()
	obCfg := outbox.Config{Schema: sch.Name}
	if err := outbox.InitializeSchema(ctx, sch.Pool, obCfg); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(obCfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing", Outbox: ob}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := pgstore.TxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 5 WHERE id = 1"); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage("receipt-"+msg.UUID, []byte("receipt"))}, nil
	})
	opts := inboxtest.DeliverOptions{PublishTopic: "receipts"}
	for _, err := range inboxtest.Deliver(h, message.NewMessage("pay-1", []byte("{}")), 3, opts) {
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, err := range inboxtest.DeliverConcurrently(h, message.NewMessage("pay-2", []byte("{}")), 8, opts) {
		if err != nil {
			t.Fatal(err)
		}
	}
	inboxtest.RequireProcessedOnce(t, store, inbox.Key{MessageID: "pay-1", ConsumerName: "billing"})
	inboxtest.RequireProcessedOnce(t, store, inbox.Key{MessageID: "pay-2", ConsumerName: "billing"})
	inboxtest.WaitProcessed(t, ib, 2, 0)
	var balance, events int
	if err := sch.Pool.QueryRow(ctx, "SELECT (SELECT balance FROM accounts WHERE id = 1), (SELECT count(*) FROM "+obCfg.MessagesTable()+")").Scan(&balance, &events); err != nil {
		t.Fatal(err)
	}
	if balance != 10 || events != 2 {
		t.Fatalf("balance %d, outbox rows %d; want 10 and 2", balance, events)
	}
	// Without a publish topic, a handler returning messages is refused.
	errs := inboxtest.Deliver(h, message.NewMessage("pay-3", []byte("{}")), 1, inboxtest.DeliverOptions{})
	if !errors.Is(errs[0], inbox.ErrNoPublishTopic) {
		t.Fatalf("without a publish topic: %v, want ErrNoPublishTopic", errs[0])
	}
}
