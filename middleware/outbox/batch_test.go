package outbox_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
)

// TestOutboxInBatchedMode: with group commit, the output of every member of a batch is written
// in the batch's transaction: a member whose handler fails after producing leaves no outbox
// rows (savepoints: rolled back to its savepoint; optimistic: the batch rolled back and the
// others ran again alone, storing their output once), and duplicates produce nothing again.
func TestOutboxInBatchedMode(t *testing.T) {
	for _, mode := range []inbox.BatchMode{inbox.BatchOptimistic, inbox.BatchSavepoints} {
		t.Run(mode.String(), func(t *testing.T) {
			e := newEnv(t, 6)
			ob, err := outbox.New(e.cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			ib, err := inbox.New(inbox.Config{Store: e.store, ConsumerName: "billing", Outbox: ob,
				Batch: inbox.BatchConfig{Size: 4, Linger: 500 * time.Millisecond, Mode: mode}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			runs := map[string]int{}
			h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				mu.Lock()
				runs[msg.UUID]++
				n := runs[msg.UUID]
				mu.Unlock()
				if err := credit(msg); err != nil {
					return nil, err
				}
				if msg.UUID == "pay-2" && n == 1 {
					return produced(msg), errors.New("fails after producing")
				}
				return produced(msg), nil
			})
			wave := func() []error {
				ids := []string{"pay-1", "pay-2", "pay-3", "pay-4"}
				errs := make([]error, len(ids))
				var wg sync.WaitGroup
				for k, id := range ids {
					wg.Go(func() {
						ctx, cancel := context.WithTimeout(inbox.ContextWithPublishTopic(context.Background(), "billing.events"), 30*time.Second)
						defer cancel()
						m := paymentMsg(id, 1, 1)
						m.SetContext(ctx)
						_, errs[k] = h(m)
					})
				}
				wg.Wait()
				return errs
			}
			errs := wave()
			if errs[0] != nil || errs[1] == nil || errs[2] != nil || errs[3] != nil {
				t.Fatalf("first wave: %v; want only pay-2 to fail", errs)
			}
			if rows, in := e.outboxRows(), e.inboxRows(); rows != 6 || in != 3 {
				t.Fatalf("after the first wave: %d outbox rows, %d inbox rows; want 6 (two per processed message) and 3", rows, in)
			}
			for _, err := range wave() {
				if err != nil {
					t.Fatalf("second wave: %v", err)
				}
			}
			if rows, bal := e.outboxRows(), e.balance(1); rows != 8 || bal != 4 {
				t.Fatalf("after the redeliveries: %d outbox rows, balance %d; want 8 and 4 (each message's output and payment once)", rows, bal)
			}
			if n := e.int("SELECT count(DISTINCT uuid) FROM " + e.cfg.MessagesTable()); n != 8 {
				t.Fatalf("%d distinct produced UUIDs, want 8", n)
			}
		})
	}
}
