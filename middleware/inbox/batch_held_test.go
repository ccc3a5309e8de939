package inbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// TestBatchMemberWhoseKeyIsHeldWaitsForIt: a batch member whose key a delivery in flight holds
// (here a claim held open through the store) leaves the batch and is claimed alone, where it
// waits for the key: it is not acked before the holder ends, and when the holder rolls back it
// runs and its payment is applied; when the holder commits it is a duplicate. In both modes.
func TestBatchMemberWhoseKeyIsHeldWaitsForIt(t *testing.T) {
	for _, mode := range batchModes {
		for _, holderCommits := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/holder-commits=%v", mode, holderCommits), func(t *testing.T) {
				e := newEnv(t, 8)
				ib := e.inbox("billing", withBatch(3, mode))
				h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) { return e.credit(msg) })
				tx, c, err := e.store.Claim(context.Background(), contract.Delivery{Key: inbox.Key{MessageID: "m-held", ConsumerName: "billing"}})
				if err != nil || c.Decision != contract.Run {
					t.Fatalf("hold the key: %v %+v", err, c)
				}
				t.Cleanup(func() { _, _ = tx.Fail(context.Background(), contract.Failure{}) })
				done := make(chan []error, 1)
				go func() {
					done <- deliverAll(h, paymentMsg("m-a", 1, 1), paymentMsg("m-held", 1, 10), paymentMsg("m-c", 1, 100))
				}()
				select {
				case errs := <-done:
					t.Fatalf("the batch returned while a member's key was held: %v (balance %d)", errs, e.balance(1))
				case <-time.After(700 * time.Millisecond):
				}
				if holderCommits {
					if err := tx.Commit(context.Background()); err != nil {
						t.Fatal(err)
					}
				} else if _, err := tx.Fail(context.Background(), contract.Failure{}); err != nil {
					t.Fatal(err)
				}
				errs := <-done
				for k, err := range errs {
					if err != nil {
						t.Fatalf("delivery %d: %v", k, err)
					}
				}
				want := int64(111)
				if holderCommits {
					want = 101 // the held copy was processed by the holder, without a payment here
				}
				if b := e.balance(1); b != want {
					t.Fatalf("balance %d, want %d", b, want)
				}
				if n := e.rows("message_id = $1", "m-held"); n != 1 {
					t.Fatalf("rows of the held key %d, want 1", n)
				}
			})
		}
	}
}
