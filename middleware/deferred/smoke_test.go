package deferred_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
)

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }

// TestReceiveAndProcess: stored rows are handled once by the workers; balances exact.
func TestReceiveAndProcess(t *testing.T) {
	ib, s := newInbox(t, deferred.Config{}, 3)
	for k := range 30 {
		m := payment("p-"+string(rune('a'+k%26))+string(rune('a'+k/26)), 1+k%3, 10, 0)
		if err := ib.Receive(m); err != nil {
			t.Fatal(err)
		}
	}
	runWorkers(t, ib.NewConsumerWorkers(credit))
	waitFor(t, 10*time.Second, "30 done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 30
	})
	if got := count(t, s.Pool, "SELECT sum(balance) FROM accounts"); got != 300 {
		t.Fatalf("balance %d, want 300", got)
	}
	st, err := ib.Stats(context.Background())
	if err != nil || st.Pending != 0 || st.Processing != 0 || st.Counters.Done != 30 {
		t.Fatalf("stats %+v %v", st, err)
	}
}
