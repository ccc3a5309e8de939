package main

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
)

// Soak bounds: a consumer is SIGKILLed after a random time in [soakMinLife, soakMaxLife).
const (
	soakMinLife = 5 * time.Second
	soakMaxLife = 20 * time.Second
)

// noPublisher lets the orchestrator build an outbox.Relay only to read its Lag; it never runs.
type noPublisher struct{}

func (noPublisher) Publish(string, ...*message.Message) error {
	return errors.New("the lag probe publishes nothing")
}
func (noPublisher) Close() error { return nil }

// soak is -soak: instead of the scripted crashes, consumers are SIGKILLed by the orchestrator
// every 5 to 20 s (random) until every unique payment is processed, while the relay's backlog
// (outbox rows not yet relayed, outbox.Relay.Lag) is sampled every 250 ms. Then the poison
// payments are published, a last consumer runs to completion and stops gracefully, and the
// run is verified like the demo: inbox rows, every balance, the dead letters, every receipt
// exactly once downstream.
func (d *demo) soak(ctx context.Context, start time.Time, rng *mrand.Rand) error {
	unique := int64(len(d.w.ids))
	probe, err := outbox.NewRelay(outbox.RelayConfig{Config: outboxConfig(d.schema), Pool: d.pool, Publisher: noPublisher{}}, nil)
	if err != nil {
		return err
	}
	consumeStart := time.Now()
	var kills int
	var maxBacklog int64
	var maxAge time.Duration
	for done := false; !done; {
		c, err := d.startConsumer(crashPoint{})
		if err != nil {
			return err
		}
		life := soakMinLife + time.Duration(rng.Int64N(int64(soakMaxLife-soakMinLife)))
		killAt := time.Now().Add(life)
		for time.Now().Before(killAt) {
			if c.exited() {
				return d.childFailure(c, fmt.Errorf("consumer #%d exited by itself: %s", c.n, c.describeExit()))
			}
			if lag, err := probe.Lag(ctx); err == nil {
				maxBacklog = max(maxBacklog, lag.Pending)
				maxAge = max(maxAge, lag.OldestAge)
			}
			rows, err := d.inboxRows(ctx)
			if err != nil {
				return d.childFailure(c, err)
			}
			if rows == unique {
				done = true
				break
			}
			if err := sleep(ctx, 250*time.Millisecond); err != nil {
				return d.childFailure(c, err)
			}
		}
		c.killAndWait()
		if !c.killedBySIGKILL() {
			return d.childFailure(c, fmt.Errorf("consumer #%d was not killed by SIGKILL: %s", c.n, c.describeExit()))
		}
		kills++
		rows, _ := d.inboxRows(ctx)
		fmt.Fprintf(d.out, "soak        consumer #%d SIGKILLed after %.1fs; inbox rows %d/%d; relay backlog so far at most %d rows (oldest %.1fs)\n",
			c.n, life.Seconds(), rows, unique, maxBacklog, maxAge.Seconds())
	}
	soakTime := time.Since(consumeStart)

	if err := d.broker.Publish(d.w.poison); err != nil {
		return err
	}
	c, _, err := d.runToCompletion(ctx)
	if err != nil {
		return err
	}
	if r, ok := c.report(lineStats); ok {
		fmt.Fprintf(d.out, "last        consumer #%d stopped with SIGTERM once everything was processed, dead-lettered and relayed (processed %d, duplicates skipped %d, dead-lettered %d)\n",
			c.n, r.Processed, r.Duplicates, r.DeadLettered)
	}
	for _, c := range d.all {
		if c.stderrContains("WARNING: DATA RACE") {
			return d.childFailure(c, fmt.Errorf("consumer #%d reported a data race", c.n))
		}
	}
	if err := d.verifyInbox(ctx, unique); err != nil {
		return err
	}
	total, err := d.verifyBalances(ctx)
	if err != nil {
		return err
	}
	if _, err := d.verifyPoison(ctx); err != nil {
		return err
	}
	if err := d.verifyReceipts(ctx, unique, total); err != nil {
		return err
	}
	pending, err := d.broker.Pending(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(d.out, "verified    %d unique payments (%d deliveries), every balance (%d cents), %d dead letters, %d receipts once each; broker %d left (%s)\n",
		unique, len(d.w.deliveries), total, len(d.w.poisonIDs), unique, pending, d.broker.pendingMeaning)
	fmt.Fprintf(d.out, "soak        %d SIGKILLs in %.1fs (%.0f unique payments/s while killing); relay backlog never above %d rows, oldest pending receipt %.1fs; %.1fs in total\n",
		kills, soakTime.Seconds(), float64(unique)/soakTime.Seconds(), maxBacklog, maxAge.Seconds(), time.Since(start).Seconds())
	return nil
}
