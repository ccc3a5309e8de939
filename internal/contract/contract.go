// Package contract is the inbox's storage contract (version 3): what the middleware asks a
// store, once per delivery, and the one decision it gets back. It is internal and sealed: the
// stores that implement it ship with this module (pgstore, and the in-memory reference store
// of the conformance suite in internal/storetest), so it can change with them. Users pass a
// store to inbox.Config.Store and never call these methods.
//
// The division of labour:
//
//   - the store owns the claim and the counting: every statement, their order, every count it
//     makes before a handler and every take-back, next to its SQL;
//   - the middleware owns what follows from a decision: running the handler, retrying a
//     transient conflict, crash isolation's gate, dead letters, outcomes and metrics.
//
// One delivery's path (docs/design.md, "One delivery"):
//
//	Claim(Delivery) ──► Run ──► handler ──► Tx.Commit ──► nil: ack
//	                │                   └─► error ────► Tx.Fail(Failure) ──► nack or dead letter
//	                ├─► Duplicate, Collision, DeadLettered: no Tx; ack (or the collision policy)
//	                ├─► Exhausted: no Tx; dead letter
//	                └─► RunAlone: no Tx; claim again alone
package contract

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"time"
)

// Key is the inbox's unique key: one message for one consumer.
type Key struct {
	// MessageID is the producer's message ID or business idempotency key (at most 512 bytes
	// of UTF-8 without NUL, not blank).
	MessageID string
	// ConsumerName names the handler that processes the message (at most 128 bytes).
	ConsumerName string
}

// Delivery is what the middleware asks the store about: claim this key, in a transaction of
// this isolation level, counting this delivery's attempt as Counting says.
type Delivery struct {
	Key Key
	// MessageType and CorrelationID are kept with the claim for debugging when non-empty.
	MessageType, CorrelationID string
	// PayloadHash is the SHA-256 of the payload as received (32 bytes), kept with the claim;
	// a duplicate whose stored hash (or the prefix a compact store keeps) differs is a
	// Collision.
	PayloadHash []byte
	// ProducerTime is when the producer created the message (zero when unknown); a store
	// partitioned by producer time files the claim under it.
	ProducerTime time.Time
	// Isolation is the transaction's isolation level; sql.LevelDefault is READ COMMITTED.
	Isolation sql.IsolationLevel
	// FinishTimeout bounds what the store does detached from ctx (a rollback after a failed
	// claim, recording a failure, releasing a lock). Zero: 10 s.
	FinishTimeout time.Duration

	// MaxAttempts, when above zero, turns on durable attempt counting (a dead-letter topic):
	// the store keeps, per key not yet processed, how many deliveries ran the handler
	// without settling, and decides Exhausted once MaxAttempts of them did.
	MaxAttempts int
	// CountFirst asks the store to count this delivery durably before the handler runs, so
	// that a crash of the consumer inside the handler is counted too. The middleware sets it
	// for a delivery its broker does not mark as a first delivery. Without it a failure is
	// counted when it is recorded (Fail), and a crash of a first delivery is not counted.
	CountFirst bool
	// Isolate asks the store to decide RunAlone for a key whose earlier attempts ended
	// without settling and without an error (crashes): crash isolation (docs/design.md).
	Isolate bool
}

// Decision is what the store decided about a delivery.
type Decision int

const (
	// Run: the key is claimed; the returned Tx is open and the handler may run.
	Run Decision = iota + 1
	// Duplicate: the key is already processed with this payload. No Tx.
	Duplicate
	// Collision: the key is already processed with another payload hash. No Tx.
	Collision
	// DeadLettered: the key was dead-lettered and not replayed since. No Tx.
	DeadLettered
	// Exhausted: MaxAttempts earlier deliveries ran the handler without settling; this one
	// must not run it. The store released the claim and took back this delivery's count. No
	// Tx: the middleware dead-letters the message.
	Exhausted
	// RunAlone: with Isolate, the key's earlier attempts ended without settling and without
	// an error. The store released the claim and took back this delivery's count; the
	// middleware claims it again once it runs alone. No Tx.
	RunAlone
)

// Claim is what a claim found.
type Claim struct {
	Decision Decision
	// Attempts is the number of earlier deliveries (this one excluded) that ran the handler
	// without settling; zero without counting.
	Attempts int
	// LastError is the last handler error recorded for the key (truncated by the store);
	// empty when none was (the deliveries crashed).
	LastError string
	// StoredAt is when the existing claim was stored, for a Duplicate or a Collision (by the
	// database's clock; a store may round it down, pgstore's compact layout to the minute).
	StoredAt time.Time
}

// Record is a key's attempt record as a store read it at a claim.
type Record struct {
	// Attempts counts the deliveries that ran (or may have run) the handler without settling,
	// this one included when Counted.
	Attempts int
	// Counted: this delivery was counted before its handler (Delivery.CountFirst).
	Counted bool
	// LastError is the last recorded handler error.
	LastError string
	// DeadLettered: the key was dead-lettered and not replayed since.
	DeadLettered bool
}

// Decide is the one rule that turns what a claim found into a Decision; every store calls
// it. claimed reports that the claim inserted the key; stored is the payload hash (or
// prefix) kept with an existing claim, nil when none.
func Decide(d Delivery, claimed bool, stored []byte, rec Record) Claim {
	earlier := rec.Attempts
	if rec.Counted {
		earlier--
	}
	c := Claim{Attempts: earlier, LastError: rec.LastError}
	switch {
	case rec.DeadLettered:
		c.Decision = DeadLettered
	case !claimed && len(stored) > 0 && !bytes.HasPrefix(d.PayloadHash, stored):
		c.Decision, c.Attempts = Collision, 0
	case !claimed:
		c.Decision, c.Attempts = Duplicate, 0
	case d.MaxAttempts > 0 && earlier >= d.MaxAttempts:
		c.Decision = Exhausted
	case d.Isolate && earlier > 0 && rec.LastError == "":
		c.Decision = RunAlone
	default:
		c.Decision = Run
	}
	return c
}

// Failure is how a delivery that ran the handler ended without committing.
type Failure struct {
	// Counts: the message's own failure (the handler's error or panic, a rollback certain at
	// COMMIT): it uses up one attempt. False: not the message's fault (a transient conflict,
	// a configuration fault, a commit of unknown outcome, shutdown): this delivery's count, if
	// the store made one, is taken back.
	Counts bool
	// Error is recorded as the key's last error when Counts (truncated by the store). Never a
	// payload.
	Error string
}

// Class is what a store makes of an error from a claim, a handler's statement or a commit.
type Class int

const (
	// Other: the message's failure, or an unknown one.
	Other Class = iota
	// Retryable: a transient conflict after which the whole transaction can be retried, and
	// the transaction is known to have rolled back (PostgreSQL SQLSTATE 40001, 40P01).
	Retryable
	// ConfigFault: the deployment's fault, not the message's (a missing privilege, table or
	// schema): no message can succeed until an operator fixes it.
	ConfigFault
)

// ErrCommitRolledBack is wrapped by a Commit error when the transaction certainly did not
// commit (the server answered COMMIT with ROLLBACK, COMMIT raised an error, or the
// transaction had ended before COMMIT). Any other Commit error has an unknown outcome.
var ErrCommitRolledBack = errors.New("inbox: commit rolled back")

// ErrTxEnded is wrapped (with ErrCommitRolledBack) by a Commit error when the handler ended,
// or tried to end, the inbox transaction itself (Commit or Rollback on the transaction it was
// given, a COMMIT or ROLLBACK statement, a closed connection): the delivery is nacked, never
// acked, since what it wrote may be gone.
var ErrTxEnded = errors.New("inbox: the handler ended the inbox transaction")

// Tx is the open transaction of a claim decided Run. Exactly one of Commit or Fail ends it;
// Fail after a failed Commit records the failure outside the transaction. Calls after that
// are no-ops.
type Tx interface {
	// Context returns ctx carrying the store's native transaction for the handler.
	Context(ctx context.Context) context.Context
	// Commit commits the claim and the handler's writes, and clears the key's attempt
	// record. An error wrapping ErrCommitRolledBack: certainly not committed; any other:
	// outcome unknown.
	Commit(ctx context.Context) error
	// Fail rolls the transaction back (when still open) and records f, so that a copy waiting
	// on the claim reads it. It returns the key's attempt count afterwards (an estimate when
	// err is not nil; 0 without counting).
	Fail(ctx context.Context, f Failure) (attempts int, err error)
}

// BatchTx is the open transaction of a batch (group commit): one native transaction shared by
// the members decided Run, whose handlers run one at a time.
type BatchTx interface {
	// Context returns ctx carrying the batch's native transaction for a member's handler.
	Context(ctx context.Context) context.Context
	// Savepoint marks the point Drop rolls back to (releasing the previous one).
	Savepoint(ctx context.Context) error
	// Healthy returns nil while the transaction is open and no statement failed since the
	// last Savepoint, or an error wrapping ErrTxEnded (the handler ended it) or saying that a
	// statement failed. It sends nothing to the server.
	Healthy() error
	// Drop takes a member (an index into the batch's deliveries) out of the batch: its
	// writes since the last Savepoint and its claim roll back, and f is recorded before the
	// key is released. It returns the member's attempt count afterwards. In a transaction
	// that is not Healthy without a savepoint, Drop only records f: the caller rolls back.
	Drop(ctx context.Context, member int, f Failure) (attempts int, err error)
	// Commit commits every member still in the batch; its errors mean what Tx.Commit's mean,
	// for each of them.
	Commit(ctx context.Context) error
	// Rollback rolls everything back and takes back the counts made for members still in.
	Rollback(ctx context.Context) error
}

// Store is a store the inbox claims on. Implementations ship with this module and pass the
// conformance suite (internal/storetest).
type Store interface {
	// Check reports whether the store can claim d at all (a compact layout needs UUID keys,
	// a partitioned one a producer time): nil, or an error whose text says why, without the
	// key. The middleware treats a refusal as an invalid key.
	Check(d Delivery) error
	// NeedsProducerTime reports whether claims must carry Delivery.ProducerTime.
	NeedsProducerTime() bool
	// RetentionWindow is the store's retention window, zero when none is configured.
	RetentionWindow() time.Duration

	// Claim claims d.Key insert-first in a new transaction and decides. Only Run returns a
	// Tx; for every other decision the store has ended its transaction. A key held by a
	// delivery in flight is waited for until ctx ends. On error no transaction is left open
	// and no count made by the call is kept.
	Claim(ctx context.Context, d Delivery) (Tx, Claim, error)
	// ClaimBatch claims the distinct keys of ds (one consumer; ds sorted by key) in one
	// transaction, in one round trip where it can, and decides for each, in ds's order.
	// Members decided other than Run are out of the transaction, which stays open for the
	// others. On error nothing is left open and no count is kept.
	ClaimBatch(ctx context.Context, ds []Delivery) (BatchTx, []Claim, error)
	// Classify says what err is.
	Classify(err error) Class

	// MarkDeadLettered records that k was published to the dead-letter topic, with reason.
	MarkDeadLettered(ctx context.Context, k Key, reason string) error
	// Replay deletes k's dead-lettered record, so its next delivery runs the handler again.
	// It reports whether k was dead-lettered.
	Replay(ctx context.Context, k Key) (bool, error)
}
