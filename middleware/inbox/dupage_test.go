package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// TestDuplicateAgeIsReported: a copy of a message processed two hours earlier (received_at set
// back in the table) is a duplicate whose Result.DuplicateAge is those two hours; the first
// delivery has none. No extra statement: the age comes with the stored payload hash.
func TestDuplicateAgeIsReported(t *testing.T) {
	e := newEnv(t, 2)
	var results []inbox.Result
	ib := e.inbox("billing", func(c *inbox.Config) {
		c.Observer = inbox.ObserverFunc(func(_ context.Context, r inbox.Result) { results = append(results, r) })
	})
	h := ib.Middleware(e.credit)
	msg := paymentMsg("m-old-copy", 2, 3)
	if err := deliver(h, msg); err != nil {
		t.Fatal(err)
	}
	e.exec("UPDATE "+e.store.Table()+" SET received_at = received_at - interval '2 hours' WHERE message_id = $1", msg.UUID)
	if err := deliver(h, msg); err != nil {
		t.Fatal(err)
	}
	if len(results) != 2 || results[0].DuplicateAge != 0 || results[1].Outcome != inbox.OutcomeDuplicate {
		t.Fatalf("results %+v", results)
	}
	if age := results[1].DuplicateAge; age < 2*time.Hour || age > 2*time.Hour+time.Minute {
		t.Fatalf("duplicate age %v, want about 2h", age)
	}
	if e.balance(2) != 3 {
		t.Fatalf("balance %d, want 3", e.balance(2))
	}
}
