package inboxtest_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/inboxtest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// Example tests a handler the way a broker treats it: a fresh PostgreSQL schema, the message
// delivered three times in a row and five times at once, then the assertion that it was
// processed once. In a real test, t is the test's *testing.T.
func Example() {
	var t *testing.T                            // your test's t
	sch := inboxtest.NewSchema(t, "billing", 8) // a schema of its own, dropped when the test ends
	store := sch.Store(t)                       // migrated
	sch.CreateAccounts(t, 1)
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := pgstore.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 1 WHERE id = 1")
		return nil, err
	})
	msg := message.NewMessage("pay-1", []byte(`{}`))
	inboxtest.Deliver(h, msg, 3, inboxtest.DeliverOptions{})
	inboxtest.DeliverConcurrently(h, msg, 5, inboxtest.DeliverOptions{})
	inboxtest.RequireProcessedOnce(t, store, inbox.Key{MessageID: "pay-1", ConsumerName: "billing"})
}
