package deferred_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
)

// TestOutboxInRowTransaction: a handler that returns a message (the immediate inbox's kind of
// handler) has it stored through the outbox in the row's transaction: one outbox row per
// handled row, committed with the credit; a failing run stores none.
func TestOutboxInRowTransaction(t *testing.T) {
	s := newSchemaOnly(t, 6)
	s.CreateAccounts(t, 1)
	obCfg := outbox.Config{Schema: s.Name}
	if err := outbox.InitializeSchema(context.Background(), s.Pool, obCfg); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(obCfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ib := inboxOn(t, s.Pool, s.Name, deferred.Config{Outbox: ob, PublishTopic: "receipts", Backoff: time.Millisecond})
	failed := false
	runWorkers(t, ib.NewWorkers(func(msg *message.Message) ([]*message.Message, error) {
		if err := credit(msg); err != nil {
			return nil, err
		}
		receipt := message.NewMessage("receipt-"+msg.UUID, []byte(`{}`))
		if msg.UUID == "p-2" && !failed {
			failed = true
			return []*message.Message{receipt}, errFirstRun
		}
		return []*message.Message{receipt}, nil
	}))
	for _, id := range []string{"p-1", "p-2"} {
		if err := ib.Receive(payment(id, 1, 5, 0)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 15*time.Second, "both rows done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 2
	})
	if n := count(t, s.Pool, "SELECT count(*) FROM "+obCfg.MessagesTable()); n != 2 {
		t.Fatalf("%d outbox rows, want 2", n)
	}
	if b := count(t, s.Pool, "SELECT balance FROM accounts WHERE id = 1"); b != 10 {
		t.Fatalf("balance %d, want 10", b)
	}
}

var errFirstRun = &runError{}

type runError struct{}

func (*runError) Error() string { return "first run fails" }
