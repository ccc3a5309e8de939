package outbox

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

type countingPublisher struct{ n atomic.Int64 }

func (p *countingPublisher) Publish(string, ...*message.Message) error {
	time.Sleep(5 * time.Millisecond)
	p.n.Add(1)
	return nil
}
func (p *countingPublisher) Close() error { return nil }

// TestBatchEndRefusesLatePublishes: a publish that joins before the batch ends is waited for
// by end; one handed over after end began (the subscriber gave up on its ack on a graceful
// stop and commits what was acked) publishes nothing and counts nothing, so no publish
// outlives its batch and wg.Add never races wg.Wait (the race detector caught that in CI).
func TestBatchEndRefusesLatePublishes(t *testing.T) {
	r := &Relay{cfg: RelayConfig{AckDeadline: time.Second}, slots: make(chan struct{}, 4)}
	pub := &countingPublisher{}
	tx := &relayTx{relay: r}
	if err := tx.publish(pub, "topic", message.NewMessage("a", nil)); err != nil {
		t.Fatalf("publish before the end: %v", err)
	}
	tx.end()
	if got := pub.n.Load(); got != 1 {
		t.Fatalf("end returned with %d of 1 publishes done", got)
	}
	if err := tx.publish(pub, "topic", message.NewMessage("b", nil)); !errors.Is(err, errBatchEnded) {
		t.Fatalf("publish after the end: %v, want errBatchEnded", err)
	}
	time.Sleep(20 * time.Millisecond)
	if got, pubd, inFlight := pub.n.Load(), tx.published, r.stats.inFlight.Load(); got != 1 || pubd != 1 || inFlight != 0 {
		t.Fatalf("after a refused publish: broker got %d, batch counted %d, in flight %d; want 1, 1, 0", got, pubd, inFlight)
	}
}
