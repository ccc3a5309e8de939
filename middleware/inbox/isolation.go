package inbox

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"golang.org/x/sync/semaphore"
)

// Crash isolation (docs/design.md, "Crash isolation"). A delivery counted before its handler
// ran stays counted when the process dies, whichever delivery killed it: every delivery in
// flight in the process is charged one attempt, as SQS charges a receive to every message a
// dead consumer held. To keep a healthy message from being dead-lettered for its neighbours'
// crashes, a delivery whose key already has attempts that ended unsettled (an attempt record
// with attempts and no recorded error: only crashes, and deliveries abandoned with their
// connection, leave that) runs its handler alone among this Inbox's deliveries in the
// process: it takes its count back, waits until no other delivery of this Inbox is in flight,
// and runs with every other delivery held at the gate. A crash during that run is its own.
// Each healthy bystander is charged at most the one crash it shared before it was a suspect.
//
// Only with a dead-letter topic (attempt counting), and only in the immediate mode.

// gateWeight is the crash-isolation gate's capacity: a delivery takes 1, a suspect all of it.
const gateWeight = 1 << 30

// gateHold is what a delivery holds of the gate.
type gateHold int

const (
	gateNone      gateHold = iota // nothing (no attempt counting, or not yet)
	gateShared                    // 1: runs alongside other deliveries
	gateExclusive                 // gateWeight: runs alone
)

// newGate returns the crash-isolation gate.
func newGate() *semaphore.Weighted { return semaphore.NewWeighted(gateWeight) }

// enterGate takes d's shared hold on the gate, waiting while a suspect runs alone, at most
// ClaimTimeout: past that (the suspect's handler waits for this delivery, or runs longer), d
// goes on without a hold, unisolated (and is no suspect itself), and the wait is logged. It
// reports false when d's context ended first (the consumer is shutting down).
func (i *Inbox) enterGate(d *delivery) bool {
	if i.gate == nil {
		return true
	}
	if i.gate.TryAcquire(1) { // no suspect waiting or running: no timer needed
		d.gate = gateShared
		return true
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(d.ctx, i.cfg.ClaimTimeout)
	err := i.gate.Acquire(ctx, 1)
	cancel()
	if err == nil {
		d.gate = gateShared
		return true
	}
	if d.ctx.Err() != nil {
		return false
	}
	i.logger.Info("Crash isolation: a delivery running alone kept this one waiting past ClaimTimeout; running it alongside", watermill.LogFields{
		"message_uuid": safeUUID(d.msg.UUID), "waited": time.Since(start).Round(time.Millisecond).String(),
	})
	return true
}

// leaveGate gives back whatever d holds of the gate.
func (i *Inbox) leaveGate(d *delivery) {
	switch d.gate {
	case gateShared:
		i.gate.Release(1)
	case gateExclusive:
		i.gate.Release(gateWeight)
	}
	d.gate = gateNone
}

// isolate turns d's shared hold into an exclusive one: it waits until no other delivery of
// this Inbox holds the gate, at most ClaimTimeout. Past that (a handler of this Inbox that
// waits for another delivery of it, or handlers longer than ClaimTimeout), or when d's context
// ends, d goes on with a shared hold, unisolated, and the wait is logged. It reports false
// when d's context ended (d holds nothing then).
func (i *Inbox) isolate(d *delivery) bool {
	d.isolationTried = true
	i.leaveGate(d)
	start := time.Now()
	ctx, cancel := context.WithTimeout(d.ctx, i.cfg.ClaimTimeout)
	err := i.gate.Acquire(ctx, gateWeight)
	cancel()
	if err == nil {
		d.gate = gateExclusive // counted in Stats.Isolated when its handler runs (try)
		return true
	}
	if d.ctx.Err() != nil {
		return false
	}
	i.logger.Info("Crash isolation: the delivery could not run alone within ClaimTimeout; running it alongside others", watermill.LogFields{
		"message_uuid": safeUUID(d.msg.UUID), "waited": time.Since(start).Round(time.Millisecond).String(),
	})
	return i.enterGate(d)
}
