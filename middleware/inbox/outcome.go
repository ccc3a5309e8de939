package inbox

import (
	"context"
	"time"
)

// Outcome is how one delivery ended. Every delivery that reaches the inbox ends in exactly
// one outcome, settled in one place and reported to Config.Observer.
type Outcome int

const (
	// OutcomeProcessed: the handler ran and the transaction committed; the router acks.
	OutcomeProcessed Outcome = iota + 1
	// OutcomeDuplicate: the key was already processed; the handler did not run; the router
	// acks.
	OutcomeDuplicate
	// OutcomeCollision: the key was already processed with a different payload and
	// Config.OnKeyCollision is CollisionSkip: the handler did not run; the router acks. (A
	// collision dead-lettered is OutcomeDeadLettered; one rejected is OutcomeFailedFinal
	// with ErrKeyCollision.)
	OutcomeCollision
	// OutcomeDeadLettered: the message was published to the dead-letter topic; the router
	// acks.
	OutcomeDeadLettered
	// OutcomeDeadLetteredSkip: the message had been dead-lettered before (and not replayed);
	// the handler did not run; the router acks.
	OutcomeDeadLetteredSkip
	// OutcomeFailedRetryable: the delivery failed and is nacked; its redelivery may succeed
	// (a handler error, a database or broker fault, a commit of unknown outcome, shutdown).
	OutcomeFailedRetryable
	// OutcomeFailedFinal: the delivery failed in a way redelivery cannot fix (a permanent
	// error, an invalid key) and there is no dead-letter topic to take it, or its dead letter
	// could not be published: it is nacked.
	OutcomeFailedFinal
)

// String returns the outcome's name as used in logs and metric labels: "processed",
// "duplicate", "collision", "dead_lettered", "dead_lettered_skip", "failed_retryable",
// "failed_final".
func (o Outcome) String() string {
	switch o {
	case OutcomeProcessed:
		return "processed"
	case OutcomeDuplicate:
		return "duplicate"
	case OutcomeCollision:
		return "collision"
	case OutcomeDeadLettered:
		return "dead_lettered"
	case OutcomeDeadLetteredSkip:
		return "dead_lettered_skip"
	case OutcomeFailedRetryable:
		return "failed_retryable"
	case OutcomeFailedFinal:
		return "failed_final"
	}
	return "unknown"
}

// Acked reports whether the router acks a delivery with this outcome (the middleware returns
// nil): every outcome but the two failed ones.
func (o Outcome) Acked() bool {
	return o != OutcomeFailedRetryable && o != OutcomeFailedFinal
}

// Result describes how one delivery ended, for Config.Observer. It carries no payload.
type Result struct {
	// Outcome is how the delivery ended.
	Outcome Outcome
	// Key is the claimed key; its MessageID is empty when the key was invalid.
	Key Key
	// MessageUUID is the Watermill message UUID as received (it may differ from the key).
	MessageUUID string
	// Route is the message's route with Config.Stores (the name of the store it was claimed
	// on); empty with a single Store, and when the route or the key was refused.
	Route string
	// Attempts is the message's attempt count after this delivery, when attempts are
	// counted (a dead-letter topic is configured); 0 otherwise.
	Attempts int
	// TxRetries is the number of in-process transaction retries after transient conflicts.
	TxRetries int
	// Isolated reports that the delivery ran its handler alone among its Inbox's deliveries
	// in the process, because its key had attempts that ended unsettled (crash isolation,
	// docs/design.md; Stats.Isolated counts them).
	Isolated bool
	// Err is the error returned to the router (nil when acked), or, for a dead letter, the
	// cause that dead-lettered it.
	Err error
	// Reason is the dead-letter reason, for OutcomeDeadLettered.
	Reason string
	// Collision reports a key collision (the key already processed with a different payload
	// hash), whatever became of it: OutcomeCollision, OutcomeDeadLettered or
	// OutcomeFailedFinal. (An invalid key is a Result whose Key.MessageID is empty.)
	Collision bool
	// DuplicateAge is, for a duplicate (and a key collision), how long before this delivery
	// the key's claim was stored: the age of the copy that arrived. The retention window must
	// be longer than the oldest duplicate a consumer gets (inboxmetrics exports it as a
	// histogram). Measured against the database's clock, rounded down to the minute in
	// pgstore's compact layout; zero for other outcomes.
	DuplicateAge time.Duration
	// Claim, Handler and Commit are the time spent in the last transaction's claim
	// (including a wait behind a concurrent copy), handler and commit. Zero when the step
	// did not run.
	Claim, Handler, Commit time.Duration
}

// Observer is told how each delivery ended (Config.Observer): the hook where metrics and
// tracing attach.
type Observer interface {
	// ObserveDelivery is called once per delivery with its context (the message's, as
	// received) and result. It must not block.
	ObserveDelivery(ctx context.Context, r Result)
}

// ObserverFunc adapts a function to Observer.
type ObserverFunc func(ctx context.Context, r Result)

// ObserveDelivery calls f(ctx, r).
func (f ObserverFunc) ObserveDelivery(ctx context.Context, r Result) { f(ctx, r) }
