package inbox

import (
	"context"
	"database/sql"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// The storage contract (version 2). It may still change before 1.0; docs/design.md explains
// it, with a diagram of one delivery's path.
//
// A store is one package per database (pgstore for PostgreSQL with pgx v5); storetest holds
// the conformance suite every store must pass and MemStore, the in-memory reference store.
// The core contract, Store, is what every transactional database can do. Optional
// capabilities (AttemptStore, Purger) are separate interfaces that the inbox finds by a type
// assertion, the way Watermill finds message.SubscribeInitializer. Methods take parameter
// structs, so a field can be added without breaking an implementation.

// Key is the inbox's unique key: one message for one consumer.
type Key struct {
	// MessageID is the producer's message ID or business idempotency key: valid UTF-8 without
	// NUL, not blank, at most MaxKeyBytes bytes (see ValidateKey).
	MessageID string
	// ConsumerName names the handler that processes the message (at most
	// MaxConsumerNameBytes bytes). Handlers with different consumer names each process a
	// message once and never block each other.
	ConsumerName string
}

// ClaimParams are the inputs of Store.Claim.
type ClaimParams struct {
	// Key is claimed insert-first.
	Key Key
	// Isolation is the transaction's isolation level. sql.LevelDefault means READ COMMITTED.
	// Stores return an error wrapping ErrInvalidConfig for levels they do not support.
	Isolation sql.IsolationLevel
	// MessageType and CorrelationID are kept with the claim for debugging when non-empty;
	// they take no part in deduplication.
	MessageType, CorrelationID string
	// PayloadHash is the SHA-256 of the payload as received (32 bytes), kept with the claim
	// so a later delivery with the same key and another payload is seen as a key collision.
	PayloadHash []byte
	// FinishTimeout bounds whatever the store does detached from ctx on the caller's behalf
	// (a rollback after a failed claim, releasing a lock); zero means DefaultFinishTimeout.
	FinishTimeout time.Duration
	// ProducerTime is when the producer created the message, as Config.ProducerTime read it;
	// zero when not configured or absent. A store partitioned by producer time (pgstore's
	// partitioned mode with ProducerTimeFromClaim) files the claim under it, so it must be
	// the same for every copy of the message.
	ProducerTime time.Time
}

// ClaimResult is what Store.Claim learned about a key.
type ClaimResult struct {
	// Claimed is true when this transaction inserted the claim: the returned Tx is open and
	// the handler may run. False for a duplicate: the store has already ended its
	// transaction and returned no Tx.
	Claimed bool
	// StoredPayloadHash is the payload hash kept with the existing claim, for a duplicate;
	// nil when the claim is new or the row has none. A store that keeps only a prefix of the
	// SHA-256 (pgstore's compact layout keeps 2 bytes) returns that prefix, at least 2 bytes
	// long; the inbox compares it with the same prefix of the new payload's hash.
	StoredPayloadHash []byte
}

// Store is the inbox's storage: it opens a transaction and claims a key in it. Every
// implementation must pass the conformance suite in package storetest.
//
// The guarantee lives in the store's unique key on (message ID, consumer name) and in its
// transactions, never in process memory.
type Store interface {
	// Claim opens a transaction with p.Isolation and, inside it, inserts p.Key unless it
	// exists, without a prior read (insert-first: two concurrent claims of one key
	// serialise on the unique key; the second waits for the first to commit or roll back).
	// When the claim is new it returns the open Tx. For a duplicate it ends the transaction
	// itself and returns a nil Tx with Claimed false. On error no transaction is left open;
	// the error is the database's, wrapped with the failing step.
	Claim(ctx context.Context, p ClaimParams) (Tx, ClaimResult, error)

	// Retryable reports whether err (from Claim, from the handler's statements in the
	// transaction, or from Commit) is a transient conflict after which the whole
	// transaction, claim included, can be retried: on PostgreSQL SQLSTATE 40001
	// (serialization_failure) and 40P01 (deadlock_detected). The transaction is known to
	// have rolled back.
	Retryable(err error) bool
}

// Tx is an open inbox transaction. Exactly one of Commit or Rollback (or, for a CountedTx,
// Fail) must be called; each releases the underlying connection. Calls after the first are
// no-ops that return nil.
type Tx interface {
	// Context returns ctx carrying the store's native transaction, so the handler's business
	// writes join it (for the pgx store: pgstore.TxFromContext).
	Context(ctx context.Context) context.Context
	// Commit commits the claim and everything written in the transaction. An error wrapping
	// ErrCommitRolledBack means the server rolled the transaction back for certain (a
	// statement had failed, or COMMIT itself raised an error such as a deferred constraint);
	// any other non-nil error means the outcome is unknown (the connection broke after COMMIT
	// was sent): the caller must not ack, and the redelivery resolves as a duplicate if it
	// did commit.
	Commit(ctx context.Context) error
	// Rollback discards the transaction.
	Rollback(ctx context.Context) error
}

// AttemptRecord is the durable attempt state of a key that has not been processed. (A record
// can outlive its key's processing: a claim with NoRecord neither reads nor clears it, see
// CountedClaimParams.NoRecord; the key's next counted claim, Replay or the purge of its inbox
// row removes it.)
type AttemptRecord struct {
	// Attempts counts the deliveries whose handler ran (or may have run: a crash) without
	// settling, this delivery included when it was counted before its claim.
	Attempts int
	// LastError is the last recorded handler error, truncated by the store; empty when none
	// was recorded (the deliveries crashed). Never a payload.
	LastError string
	// DeadLettered is true once the message was published to the dead-letter topic (and not
	// replayed since). DeadLetterReason says why.
	DeadLettered bool
	// DeadLetterReason is the reason stored with the dead-lettered state (truncated).
	DeadLetterReason string
}

// CountedClaimParams are the inputs of AttemptStore.ClaimCounted.
type CountedClaimParams struct {
	ClaimParams
	// CountFirst asks the store to count this delivery durably before it claims: in a
	// transaction of its own, committed first, so the count survives the claim's rollback
	// and a crash of the consumer. Set it for a delivery that may be a redelivery (see
	// Redelivery). Deliveries that count first serialise per key before counting, and count
	// nothing when the key is already processed, so copies waiting behind a running delivery
	// are never counted.
	CountFirst bool
	// CountLimit, when above zero, is the most attempts counting first may bring the key's
	// record to: a delivery whose record already holds CountLimit attempts is not counted
	// (Counted false; the inbox sets MaxAttempts), since it will not run the handler: its
	// attempts are used up. So a record never shows more attempts than deliveries that ran the
	// handler, not even for a moment. Zero: no limit.
	CountLimit int
	// NoRecord, without CountFirst, asks for the claim alone: the store does not read the
	// key's attempt record, so the claim costs what Store.Claim costs (pgstore: the attempts
	// table is not touched, one statement fewer in the claim's round trip). Record is then
	// zero, a dead-lettered key is claimed like any other (a Fail of it changes nothing and
	// returns 0), and Commit does not delete a record: a record the key has belongs to
	// another copy (one that failed or crashed and waits for its redelivery, whose counted
	// claim is then a duplicate and deletes it) or is dead-lettered (moot once the key is
	// processed: Replay refuses it and the purge of the key's row deletes it). The immediate
	// inbox sets it for a delivery its broker signals as a first delivery (Redelivery), the
	// first time it sees the message (not on a re-entry through an outer Retry); its failure
	// is recorded after the fact: Fail's count includes the key's earlier attempts. Ignored
	// with CountFirst.
	NoRecord bool
}

// CountedClaimResult is what AttemptStore.ClaimCounted learned.
type CountedClaimResult struct {
	ClaimResult
	// Record is the key's attempt record as it stood at the claim (this delivery's own
	// count included when Counted). For a duplicate it is zero.
	Record AttemptRecord
	// Counted is true when this delivery was counted before its claim.
	Counted bool
}

// FailParams are the inputs of CountedTx.Fail.
type FailParams struct {
	// AttemptsDelta is added to the attempt record: 1 for a failed delivery that was not
	// counted before its claim, 0 for one that was, -1 to take back a count made before the
	// claim (a delivery abandoned because its consumer is shutting down).
	AttemptsDelta int
	// Error is stored as the last error (truncated by the store) when non-empty.
	Error string
}

// CountedTx is the transaction of a counted claim.
type CountedTx interface {
	Tx
	// Fail ends the transaction without processing the message: the handler's writes and
	// the claim roll back, and the attempt record is updated (p) in the same commit, so a
	// concurrent copy waiting on the claim sees the updated record. It returns the record's
	// attempt count afterwards (0 when the key is processed or dead-lettered: see
	// AdjustAttempts). On a store error the record is updated after the rollback
	// instead, best effort, and the error is returned.
	Fail(ctx context.Context, p FailParams) (attempts int, err error)
}

// AttemptParams name a key for the attempt-record methods of AttemptStore.
type AttemptParams struct {
	// Key is the message and consumer whose record is read or changed.
	Key Key
	// AttemptsDelta is added to the count by AdjustAttempts (see FailParams).
	AttemptsDelta int
	// Error is the last error for AdjustAttempts, the reason for MarkDeadLettered.
	Error string
}

// AttemptStore is the optional capability behind durable attempt counting and dead letters
// (Config.DeadLetterPublisher): a store that keeps, per key not yet processed, how many
// deliveries ran its handler without settling, the last error, and whether it was
// dead-lettered. The inbox refuses a dead-letter topic on a store without it.
type AttemptStore interface {
	Store
	// ClaimCounted is Claim with the key's attempt record: with the claim it reads the
	// record (as committed after any wait for the claim); a successful Commit deletes it, a
	// Rollback leaves it (with NoRecord the record is neither read nor deleted: see
	// CountedClaimParams). Every counted claim of a key holds the key's lock while it counts
	// and while its transaction is open, so no copy counts while it runs. A key whose record
	// is dead-lettered is not claimed (unless with NoRecord): the store ends its transaction
	// and returns a nil Tx with Record.DeadLettered set. A duplicate leaves no record behind and no transaction
	// open. A claim that fails (a lock timeout, ctx ending while it waits) takes back a count
	// it made.
	ClaimCounted(ctx context.Context, p CountedClaimParams) (CountedTx, CountedClaimResult, error)
	// AdjustAttempts adds p.AttemptsDelta to the key's attempt record outside any claim,
	// and stores p.Error as its last error when non-empty; a positive delta creates the
	// record unless the key is already processed. It returns the count afterwards; a
	// positive delta returns 0 for a key that is processed or dead-lettered, whose record it
	// leaves as it is (a count after a dead letter, or after processing, counts nothing). Used
	// when a claim transaction ended without Fail (a rollback certain at COMMIT).
	AdjustAttempts(ctx context.Context, p AttemptParams) (attempts int, err error)
	// MarkDeadLettered records that the key was published to the dead-letter topic, with
	// p.Error as the reason. Later ClaimCounted calls report it until Replay (those with
	// NoRecord do not read it: see CountedClaimParams).
	MarkDeadLettered(ctx context.Context, p AttemptParams) error
	// Replay deletes the key's dead-lettered attempt record, so its next delivery runs the
	// handler again. It reports whether the key was dead-lettered and is not processed: a
	// dead-lettered record whose key was processed since (a first delivery of a copy the
	// producer sent again, claimed with NoRecord) is moot; Replay deletes it too and reports
	// false, since republishing the message would apply it again once the inbox row is
	// purged. A store that purges inbox rows (Purger) deletes the moot dead-lettered records of
	// the keys it purges, for the same reason.
	Replay(ctx context.Context, p AttemptParams) (bool, error)
}

// FaultClassifier is an optional capability of a Store: it recognises errors that are the
// deployment's fault, not the message's (a missing privilege, a missing table or column),
// so the inbox nacks such a delivery without using up one of its attempts, and logs it at
// ERROR: no message can succeed until an operator fixes the configuration.
type FaultClassifier interface {
	// ConfigurationFault reports whether err (from the handler's statements, the outbox or
	// COMMIT) is a configuration fault. pgstore: SQLSTATE class 42 (syntax error or access
	// rule violation: 42501 insufficient_privilege, 42P01 undefined_table, 42703
	// undefined_column...), class 28 (invalid authorization), 3D000 and 3F000 (no such
	// database or schema).
	ConfigurationFault(err error) bool
}

// PurgeParams are the inputs of Purger.Purge.
type PurgeParams struct {
	// Before: rows of processed messages older than this are deleted.
	Before time.Time
	// BatchSize bounds the rows deleted per transaction; zero means 5,000.
	BatchSize int
	// ConsumerName, when non-empty, limits the purge to one consumer.
	ConsumerName string
}

// PurgeResult reports what Purger.Purge did.
type PurgeResult struct {
	// Deleted is the number of inbox rows deleted.
	Deleted int64
	// Batches is the number of delete transactions run.
	Batches int
}

// Purger is the optional capability of deleting processed rows past the retention window.
// Purging a row lets a later redelivery of its message through as new: Before must be
// older than the longest redelivery, replay or offset reset the consumer supports.
type Purger interface {
	// Purge deletes processed rows older than p.Before in bounded batches, oldest first,
	// until a batch deletes fewer rows than its size or ctx ends.
	Purge(ctx context.Context, p PurgeParams) (PurgeResult, error)
}

// Outbox stores the messages a handler returns inside the inbox transaction, so they commit
// or roll back with the claim and the business writes; a relay publishes them to the broker
// after the commit (package outbox). Without an Outbox the inbox refuses handler output
// (ErrProducedMessages).
type Outbox interface {
	// Store writes msgs, destined for topic, in the inbox transaction tx (the delivery's own,
	// as the store returned it). Their UUIDs and metadata must be kept. ctx is the handler's
	// context.
	Store(ctx context.Context, tx Tx, topic string, msgs []*message.Message) error
}

// BatchClaimParams are the inputs of BatchStore.ClaimBatch.
type BatchClaimParams struct {
	// Claims are the batch's members: distinct keys of one consumer, in the order the store
	// takes their locks and inserts their claims. The inbox sorts them by key, so two batches
	// never wait on each other's keys in opposite orders.
	Claims []CountedClaimParams
	// Counted asks for AttemptStore semantics: every member's key is locked (as by
	// ClaimCounted) until the batch ends, members with CountFirst are counted before the
	// claim, and each result carries the key's attempt record. False: plain claims (Claim).
	Counted bool
	// Isolation is the batch transaction's isolation level (sql.LevelDefault: READ
	// COMMITTED); stores refuse unsupported levels with an error wrapping ErrInvalidConfig.
	Isolation sql.IsolationLevel
	// FinishTimeout bounds what the store does detached from ctx (see ClaimParams).
	FinishTimeout time.Duration
}

// BatchStore is the optional capability behind group commit (Config.Batch): one transaction
// claims the keys of several concurrent deliveries and runs their handlers one after another,
// and one COMMIT settles them all.
type BatchStore interface {
	Store
	// BatchSupported returns nil when this store, as configured, can claim batches, or an
	// error saying why not (pgstore: the compact and partitioned layouts cannot yet). Config
	// validation calls it, so a batched inbox on such a store is refused at start-up.
	BatchSupported() error
	// ClaimBatch opens one transaction and, inside it, claims every key of p.Claims
	// insert-first, as Claim (or ClaimCounted, with p.Counted) would, in one round trip
	// where the database allows. It returns the open BatchTx and one result per member, in
	// the order of p.Claims: Claimed members' claims are held by the transaction; a
	// duplicate or a dead-lettered key is not claimed (its result says which, as Claim and
	// ClaimCounted report them) and the transaction stays open for the others. On error no
	// transaction is left open and counts made by the call are taken back.
	ClaimBatch(ctx context.Context, p BatchClaimParams) (BatchTx, []CountedClaimResult, error)
}

// BatchTx is the open transaction of a batch. Its handlers run one at a time: a database
// connection is not safe for concurrent use.
//
// Context carries the one native transaction every member's handler writes through
// (pgstore.TxFromContext). Commit commits the claims of every member still in the batch and
// their handlers' writes, deletes the attempt records of the counted members it processed,
// and releases the keys' locks; its errors mean what Tx.Commit's mean, for every member.
// Rollback rolls everything back and takes back the counts ClaimBatch made for members still
// in the batch (none of them failed: a failure is recorded by Drop first).
type BatchTx interface {
	Tx
	// Savepoint marks the point Drop rolls back to (releasing the previous savepoint): the
	// savepoint design (BatchSavepoints) calls it before each member's handler.
	Savepoint(ctx context.Context) error
	// Drop takes member (an index into BatchClaimParams.Claims) out of the batch: its
	// handler's writes since the last Savepoint and its claim are rolled back inside the
	// transaction, and p is applied to its attempt record (with p's meaning in
	// CountedTx.Fail) before the key's lock is released, so the next delivery of the message
	// reads it. It returns the member's attempt count afterwards. In a transaction that
	// Aborted without a savepoint, Drop only records p: the caller must roll the batch back.
	Drop(ctx context.Context, member int, p FailParams) (attempts int, err error)
	// Aborted reports whether a statement of the transaction failed since the last Savepoint
	// (PostgreSQL: the transaction is in the failed state, SQLSTATE 25P02 for the next
	// statement), so that a handler that swallowed a database error is seen at once.
	Aborted() bool
}
