package inbox_test

import (
	"testing"
	"time"

	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// TestBatchedTooOldIsDeadLetteredAndNotRun: the TooOldGuard holds in the batched mode too. A
// too-old message delivered together with a message inside the window, in one batch, is
// dead-lettered with ReasonTooOld before any claim (no inbox row, no attempt counted, the
// handler never runs), and the other is processed.
func TestBatchedTooOldIsDeadLetteredAndNotRun(t *testing.T) {
	for _, mode := range batchModes {
		t.Run(mode.String(), func(t *testing.T) {
			e := newEnv(t, 4)
			dl := newDeadLetters(t)
			ib := e.inbox("billing", withDeadLetters(dl, 3), withBatch(2, mode), func(c *inbox.Config) {
				c.Store = e.hourlyStore()
				c.TooOld = inbox.TooOldGuard{ProducerTime: inbox.ProducerTimeFromUUIDv7()}
			})
			h := ib.Middleware(e.credit)
			old := paymentMsg(uuidV7At(time.Now().Add(-3*time.Hour)), 1, 100)
			recent := paymentMsg(uuidV7At(time.Now().Add(-time.Hour)), 2, 10)
			for k, err := range deliverAll(h, old, recent) {
				if err != nil {
					t.Fatalf("delivery %d: %v, want nil", k, err)
				}
			}
			if e.balance(1) != 0 || e.rows("message_id = $1", old.UUID) != 0 {
				t.Fatalf("too-old message: balance %d, %d inbox rows; want none (refused before the claim)", e.balance(1), e.rows("message_id = $1", old.UUID))
			}
			if e.balance(2) != 10 || e.runs.Load() != 1 {
				t.Fatalf("inside the window: balance %d, handler runs %d; want 10, 1", e.balance(2), e.runs.Load())
			}
			got := dl.wait(t, 1)
			if r := got[0].Metadata.Get(wmmiddleware.ReasonForPoisonedKey); r != inbox.ReasonTooOld {
				t.Fatalf("dead-letter reason %q, want %q", r, inbox.ReasonTooOld)
			}
			if n, _, dead := e.attemptsRow(old.UUID); !dead || n != 0 {
				t.Fatalf("attempt record: %d attempts, dead-lettered %v; want 0 attempts, dead-lettered", n, dead)
			}
		})
	}
}
