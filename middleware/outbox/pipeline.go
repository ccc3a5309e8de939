package outbox

import (
	"context"
	"errors"
	"hash/maphash"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
)

// relayTx is one poll of the relay's watermill-sql subscriber: its REPEATABLE READ
// transaction, and the publishes of the batch it read, which run in the background (up to
// RelayConfig.MaxInFlight at once) while the subscriber hands the forwarder the next rows.
// Commit stores the batch's offset only once every one of them was confirmed by the broker.
type relayTx struct {
	tx      pollTx
	relay   *Relay
	started time.Time

	wg sync.WaitGroup

	mu        sync.Mutex
	ending    bool                     // Commit or Rollback began: no publish joins wg any more
	failed    error                    // the first failed publish of the batch
	published int                      // publishes confirmed
	skipped   int                      // malformed rows skipped (acked without a publish)
	lanes     map[uint64]chan struct{} // per ordering lane: closed when its last publish ended
}

// errBatchEnded is publish's answer for a row handed to the forwarder after its batch's
// transaction began to end: the subscriber stopped waiting for its ack (its context was
// cancelled or it is closing) and commits the rows acked before it. The row's offset is not
// stored, so it is read and published again.
var errBatchEnded = errors.New("outbox relay: the batch ended before this row was published")

// join counts one more publish of the batch, or returns false once Commit or Rollback began.
// Taking t.mu orders every wg.Add before the wg.Wait of end (sync.WaitGroup requires it).
func (t *relayTx) join() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ending {
		return false
	}
	t.wg.Add(1)
	return true
}

// end refuses further publishes and waits for those that joined.
func (t *relayTx) end() {
	t.mu.Lock()
	t.ending = true
	t.mu.Unlock()
	t.wg.Wait()
}

// failure returns the first failed publish of the batch, or nil.
func (t *relayTx) failure() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.failed
}

// publish starts the publish of msg to topic in the background and returns at once, after
// waiting for a free slot of MaxInFlight; it returns errBatchEnded, publishing nothing, once
// the batch's Commit or Rollback began. Publishes of one ordering lane (RelayConfig
// OrderingKey) run one after another, in the order publish was called. After a failed
// publish the batch publishes nothing more: it is rolled back at Commit and read again.
func (t *relayTx) publish(pub message.Publisher, topic string, msg *message.Message) error {
	if !t.join() {
		return errBatchEnded
	}
	r := t.relay
	var prev, done chan struct{}
	if r.cfg.OrderingKey != nil {
		lane := maphash.String(r.laneSeed, r.cfg.OrderingKey(topic, msg))
		done = make(chan struct{})
		t.mu.Lock()
		if t.lanes == nil {
			t.lanes = map[uint64]chan struct{}{}
		}
		prev = t.lanes[lane]
		t.lanes[lane] = done
		t.mu.Unlock()
	}
	r.slots <- struct{}{} // released when this publish ends
	r.stats.inFlight.Add(1)
	go func() {
		defer func() {
			r.stats.inFlight.Add(-1)
			<-r.slots
			if done != nil {
				close(done)
			}
			t.wg.Done()
		}()
		if prev != nil {
			<-prev
		}
		if t.failure() != nil {
			return
		}
		// The subscriber cancels the message's context once the forwarder acked it, which is
		// now: the publish gets a context of its own, bounded by AckDeadline.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(msg.Context()), r.cfg.AckDeadline)
		defer cancel()
		msg.SetContext(ctx)
		err := pub.Publish(topic, msg)
		t.mu.Lock()
		defer t.mu.Unlock()
		if err != nil {
			if t.failed == nil {
				t.failed = err
				r.logger.Error("Outbox relay could not publish a message; its batch is rolled back and published again", err,
					watermill.LogFields{"message_uuid": msg.UUID, "destination_topic": topic})
			}
			return
		}
		t.published++
	}()
	return nil
}

// Commit waits for the batch's publishes, then commits the subscriber's transaction (the
// consumer group's offset after the last row the forwarder acked) on a detached context. When
// a publish failed it rolls back instead, so every row of the batch is read and published
// again (at least once), waits ResendInterval (or until the relay is closed), and returns
// errBatchFailed.
func (t *relayTx) Commit() error {
	t.end()
	r := t.relay
	ctx, cancel := r.detached(context.Background())
	defer cancel()
	if err := t.failure(); err != nil {
		_ = t.tx.rollback(ctx)
		r.stats.failedBatches.Add(1)
		r.report(t, false)
		select {
		case <-time.After(r.cfg.ResendInterval):
		case <-r.closing:
		}
		return errBatchFailed
	}
	if err := t.tx.commit(ctx); err != nil {
		r.report(t, false)
		return err
	}
	t.mu.Lock()
	r.stats.relayed.Add(int64(t.published))
	did := t.published > 0 || t.skipped > 0
	t.mu.Unlock()
	if did {
		r.stats.batches.Add(1)
		r.report(t, true)
	}
	return nil
}

// Rollback waits for the batch's publishes (they are published again by the next poll) and
// rolls the transaction back on a detached context.
func (t *relayTx) Rollback() error {
	t.end()
	ctx, cancel := t.relay.detached(context.Background())
	defer cancel()
	err := t.tx.rollback(ctx)
	t.mu.Lock()
	n := t.published
	t.mu.Unlock()
	if n > 0 {
		t.relay.stats.failedBatches.Add(1)
		t.relay.report(t, false)
	}
	return err
}

// report calls RelayConfig.OnBatch, if set.
func (r *Relay) report(t *relayTx, committed bool) {
	if r.cfg.OnBatch == nil {
		return
	}
	t.mu.Lock()
	b := RelayBatch{Published: t.published, Skipped: t.skipped, Committed: committed, Duration: time.Since(t.started)}
	t.mu.Unlock()
	r.cfg.OnBatch(b)
}

// pipelinePublisher is the publisher the forwarder publishes each unwrapped message with. With
// MaxInFlight 1 it publishes at once and returns the broker's answer (the forwarder nacks a
// failure and the subscriber hands the same row again after ResendInterval). Otherwise it
// hands the publish to the batch's relayTx and returns nil, so the forwarder acks and the
// subscriber moves to the next row; the batch's Commit waits for every publish.
type pipelinePublisher struct {
	relay *Relay
	pub   message.Publisher
}

func (p pipelinePublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if m.Metadata == nil {
			// The forwarder restores a nil map from an envelope whose metadata was JSON null
			// (written by a forwarder publisher other than Outbox.Store), and a nil map panics
			// on Metadata.Set downstream.
			m.Metadata = message.Metadata{}
		}
	}
	tx, ok := wmsql.TxFromContext(msgContext(msgs))
	rtx, isRelayTx := tx.(*relayTx)
	if p.relay.cfg.MaxInFlight == 1 || !ok || !isRelayTx {
		r := p.relay
		r.stats.inFlight.Add(1)
		defer r.stats.inFlight.Add(-1)
		if err := p.pub.Publish(topic, msgs...); err != nil {
			return err
		}
		if isRelayTx {
			rtx.mu.Lock()
			rtx.published += len(msgs)
			rtx.mu.Unlock()
		}
		return nil
	}
	for _, m := range msgs {
		if err := rtx.publish(p.pub, topic, m); err != nil {
			// Nobody waits for this row's ack any more (the subscriber hands rows one at a
			// time and ends the batch only after its last send returned), so nil drops it
			// without the router's ERROR line; its offset is not stored.
			p.relay.logger.Debug("Outbox relay dropped a row handed over as its batch ended; it is read again",
				watermill.LogFields{"message_uuid": m.UUID})
			return nil
		}
	}
	return nil
}

func msgContext(msgs []*message.Message) context.Context {
	if len(msgs) == 0 {
		return context.Background()
	}
	return msgs[0].Context()
}

// Close does not close the user's publisher: the relay does not own it.
func (p pipelinePublisher) Close() error { return nil }
