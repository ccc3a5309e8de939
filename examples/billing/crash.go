//go:build unix

package main

// The demo's instrumentation of the consumer, not part of the billing service: the two crash
// points where the consumer SIGKILLs itself, and the lines it prints for the orchestrator.

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Lines the consumer writes to stdout for the orchestrator, followed by a JSON object.
const (
	// lineReady: the router is running.
	lineReady = "READY"
	// lineCrash: the inbox Stats just before the consumer SIGKILLs itself.
	lineCrash = "CRASH"
	// lineStats: the inbox Stats after a graceful stop.
	lineStats = "STATS"
	// lineSettled: the consumer settled its first billing delivery (processed, or skipped as a
	// duplicate, or dead-lettered); SettledAt says when (for the soak's recovery times).
	lineSettled = "SETTLED"
)

// consumerReport is the JSON of the consumer's stdout lines.
type consumerReport struct {
	PID int `json:"pid"`
	// Processed ... DeadLetteredSkips: the billing inbox's Stats.
	Processed         uint64 `json:"processed"`
	Duplicates        uint64 `json:"duplicates"`
	Failed            uint64 `json:"failed"`
	TxRetries         uint64 `json:"tx_retries"`
	DeadLettered      uint64 `json:"dead_lettered"`
	DeadLetteredSkips uint64 `json:"dead_lettered_skips"`
	// ReceiptsProcessed, ReceiptsDuplicates: the receipts inbox's Stats.
	ReceiptsProcessed  uint64 `json:"receipts_processed"`
	ReceiptsDuplicates uint64 `json:"receipts_duplicates"`
	// Rejected and RejectedRun: the poison payment (and its handler run, across processes) in
	// whose handler the consumer SIGKILLed itself (-crash-on-rejection).
	Rejected    string `json:"rejected,omitempty"`
	RejectedRun int64  `json:"rejected_run,omitempty"`
	// DedupHitRate and ClaimP99 (seconds) come from the billing inbox's Prometheus metrics
	// (metrics.go); null when nothing was observed.
	DedupHitRate *float64 `json:"dedup_hit_rate,omitempty"`
	ClaimP99     *float64 `json:"claim_p99_seconds,omitempty"`
	// Store-then-process mode: the deferred inbox's Counters, and the payment in whose
	// handler a worker SIGKILLed the process (-crash-after-applied).
	Deferred *deferred.Counters `json:"deferred,omitempty"`
	Applied  string             `json:"applied,omitempty"`
	// SettledAt (lineSettled): when the inbox returned nil for the consumer's first billing
	// delivery, just before the router acked it; Unix time in nanoseconds, of this machine's
	// clock, which the orchestrator shares.
	SettledAt int64 `json:"settled_at_unix_nano,omitempty"`
}

// demoRegistry is the consumer's metrics, for report.
var demoRegistry *demoMetrics

// inboxes are the consumer's two inboxes: the billing handler's and the downstream receipts
// handler's.
type inboxes struct {
	billing, receipts *inbox.Inbox
	// deferred is the billing consumer's store-then-process inbox (nil in the immediate mode).
	deferred *deferred.Inbox
}

// crashPoints are the consumer's own crashes: after its crashAfter-th processed payment,
// between the inbox's commit and the router's ack; and in the handler of a poison payment, on
// its crashOnRejection-th rejection. Zero: never.
type crashPoints struct {
	crashAfter, crashOnRejection int
	ibs                          inboxes
	gate                         crashGate
	processed                    atomic.Int64
	// crashAfterApplied, applied: the worker crash of the store-then-process mode.
	crashAfterApplied int
	applied           atomic.Int64
	// settled: the first billing delivery was settled and lineSettled printed.
	settled atomic.Bool
}

func newCrashPoints(o options, ibs inboxes) *crashPoints {
	return &crashPoints{crashAfter: o.crashAfter, crashOnRejection: o.crashOnRejection, ibs: ibs, crashAfterApplied: o.crashAfterApplied}
}

// report prints a line for the orchestrator with both inboxes' Stats.
func (c *crashPoints) report(kind string, r consumerReport) {
	b, r2 := c.ibs.billing.Stats(), c.ibs.receipts.Stats()
	r.PID = os.Getpid()
	r.Processed, r.Duplicates, r.Failed, r.TxRetries = b.Processed, b.Duplicates, b.Failed, b.TxRetries
	r.DeadLettered, r.DeadLetteredSkips = b.DeadLettered, b.DeadLetteredSkips
	r.ReceiptsProcessed, r.ReceiptsDuplicates = r2.Processed, r2.Duplicates
	if c.ibs.deferred != nil {
		counters := c.ibs.deferred.Counters()
		r.Deferred = &counters
	}
	if rate, p99 := demoRegistry.summary(); !math.IsNaN(rate) && !math.IsNaN(p99) {
		r.DedupHitRate, r.ClaimP99 = &rate, &p99
	}
	j, _ := json.Marshal(r)
	// os.Stdout is unbuffered: the line is in the pipe before the next statement runs.
	fmt.Printf("%s %s\n", kind, j)
}

// middleware is the router-level middleware of the crash points, outermost first: the gate,
// then afterCommit. Added before the handlers, both run outside each handler's inbox.
func (c *crashPoints) middleware() []message.HandlerMiddleware {
	return []message.HandlerMiddleware{c.gate.Middleware, c.afterCommit}
}

// onRejected is the billing handler's hook after it logged the run-th rejection of a poison
// payment: on the crashOnRejection-th, the process dies there, with the transaction open.
func (c *crashPoints) onRejected(msg *message.Message, run int64) {
	if c.crashOnRejection > 0 && run == int64(c.crashOnRejection) {
		c.gate.crashAlone(msg, func() { c.report(lineCrash, consumerReport{Rejected: msg.UUID, RejectedRun: run}) })
	}
}

// onApplied is the billing handler's hook after it applied a payment, in the store-then-process
// mode's worker, with the row's transaction open: on the crashAfterApplied-th, the process dies
// there, its worker in the middle of a claimed batch.
func (c *crashPoints) onApplied(msg *message.Message) {
	if c.crashAfterApplied > 0 && c.applied.Add(1) == int64(c.crashAfterApplied) {
		c.report(lineCrash, consumerReport{Applied: msg.UUID})
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {}
	}
}

// handlerRanKey carries an *atomic.Bool that the billing handler sets (markHandlerRan), so
// afterCommit can tell a processed payment (handler ran, inbox committed) from a skipped
// duplicate or a receipt.
type handlerRanKey struct{}

// markHandlerRan records, for afterCommit, that the billing handler applied msg.
func markHandlerRan(msg *message.Message) {
	if ran, ok := msg.Context().Value(handlerRanKey{}).(*atomic.Bool); ok {
		ran.Store(true)
	}
}

// afterCommit runs outside the inbox. When the inbox returns nil after the billing handler
// ran, the inbox transaction has committed and the router has not acked yet: it acks after this
// function returns. With crashAfter > 0 it SIGKILLs the process right there, after the
// crashAfter-th processed payment: committed, never acked.
func (c *crashPoints) afterCommit(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ran := new(atomic.Bool)
		msg.SetContext(context.WithValue(msg.Context(), handlerRanKey{}, ran))
		out, err := h(msg)
		if err == nil && message.HandlerNameFromCtx(msg.Context()) == consumerName && !c.settled.Swap(true) {
			// The first billing delivery this process settles: the router acks it next.
			c.report(lineSettled, consumerReport{SettledAt: time.Now().UnixNano()})
		}
		if c.ibs.deferred != nil && err == nil && c.crashAfter > 0 && message.HandlerNameFromCtx(msg.Context()) == consumerName &&
			c.ibs.deferred.Counters().Received >= uint64(c.crashAfter) {
			// Store-then-process: the receipt committed (this delivery's row, or a duplicate
			// of a stored one) and the router has not acked it.
			c.gate.crashAlone(msg, func() { c.report(lineCrash, consumerReport{}) })
		}
		if err != nil || !ran.Load() {
			return out, err
		}
		if n := c.processed.Add(1); c.crashAfter > 0 && n == int64(c.crashAfter) {
			// SIGKILL cannot be caught: the ack after this return never happens.
			c.gate.crashAlone(msg, func() { c.report(lineCrash, consumerReport{}) })
		}
		return out, err
	}
}

// crashGate is the outermost middleware. It lets the consumer's own crashes (crashAlone: after
// the K-th commit, and inside a poison payment's handler) wait until every other delivery has
// left its inbox, and makes new ones wait before entering one.
//
// A real crash lands anywhere, and costs every delivery it interrupts inside the inbox one
// counted attempt. That is what the design promises, and the orchestrator's mid-stream kill
// shows it; but it would blur the exact numbers the demo checks for poison payments: a crash
// between the inbox's attempt count and the handler costs an attempt without a handler run (the
// message is dead-lettered after one run fewer), and a crash between publishing a dead letter
// and recording it publishes the dead letter again (dead letters are at least once). So the
// consumer's own crashes interrupt nothing but the delivery they happen in, and "MaxAttempts
// handler runs, one dead letter" is checked exactly; and a payment loses at most two attempts to
// crashes (its delivery and its re-sent duplicate, both inside the inbox at the mid-stream
// kill), so MaxAttempts 3 still applies it.
type crashGate struct {
	mu      sync.RWMutex
	crashed atomic.Bool
}

type gateLeaveKey struct{}

// Middleware holds the gate's read lock for the whole delivery.
func (g *crashGate) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		g.mu.RLock()
		leave := sync.OnceFunc(g.mu.RUnlock)
		defer leave()
		msg.SetContext(context.WithValue(msg.Context(), gateLeaveKey{}, leave))
		return h(msg)
	}
}

// crashAlone SIGKILLs the process, inside the delivery of msg, once no other delivery is in
// the gate; report runs just before. Only the first call crashes; later calls return at once.
func (g *crashGate) crashAlone(msg *message.Message, report func()) {
	if !g.crashed.CompareAndSwap(false, true) {
		return
	}
	if leave, ok := msg.Context().Value(gateLeaveKey{}).(func()); ok {
		leave() // this delivery stays in its transaction, but must not wait for itself
	}
	g.mu.Lock()
	report()
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}
