package inbox

import (
	"context"
	"database/sql"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Claim is one inbox row: the key a delivery claims, and optional metadata kept for debugging.
// Only MessageID and ConsumerName take part in deduplication.
type Claim struct {
	// MessageID is the producer's message ID or business idempotency key (validated, at most
	// MaxKeyBytes bytes).
	MessageID string
	// ConsumerName names the handler that processes the message (at most MaxConsumerNameBytes).
	ConsumerName string
	// MessageType is stored in message_type when non-empty.
	MessageType string
	// CorrelationID is stored in correlation_id when non-empty.
	CorrelationID string
	// PayloadHash is the SHA-256 of the payload (32 bytes), stored in payload_hash.
	PayloadHash []byte
}

// TxOptions are the options of the transaction that holds a claim and the handler's writes.
type TxOptions struct {
	// Isolation is the transaction's isolation level. sql.LevelDefault means READ COMMITTED on
	// PostgreSQL. Stores return an error for levels they do not support.
	Isolation sql.IsolationLevel
	// CountAttempt asks the store to count one more delivery attempt of the claim's key in a
	// transaction of its own, committed before the claim transaction begins, so the count
	// survives the claim transaction's rollback and a crash of the consumer. The claim
	// transaction then also deletes the attempt record, so a successful commit clears it.
	CountAttempt bool
	// LockTimeout bounds each lock wait in the claim transaction (PostgreSQL lock_timeout; an
	// expired wait fails with SQLSTATE 55P03). Zero keeps the server's setting.
	LockTimeout time.Duration
	// StatementTimeout bounds each statement in the claim transaction (PostgreSQL
	// statement_timeout; SQLSTATE 57014). Zero keeps the server's setting.
	StatementTimeout time.Duration
}

// ClaimResult is what BeginClaim learned about a key.
type ClaimResult struct {
	// Claimed is true when this transaction inserted the claim, false for a duplicate.
	Claimed bool
	// Attempt is this delivery's attempt number, starting at 1, when TxOptions.CountAttempt
	// was set; 0 otherwise.
	Attempt int
	// DeadLettered is true when the key was dead-lettered earlier (and not replayed since).
	// Only reported when TxOptions.CountAttempt was set.
	DeadLettered bool
	// StoredPayloadHash is the payload hash stored with the existing claim, for a duplicate;
	// nil when the claim is new or the row has no hash.
	StoredPayloadHash []byte
}

// Store is the inbox's storage: it opens a transaction and claims a message in it, and keeps
// the durable attempt count and dead-letter state of messages that have not been processed.
// It is deliberately narrow, so other databases can implement it; every implementation must
// pass the conformance suite in package storetest.
//
// The guarantee lives in the store's unique key on (message_id, consumer_name) and in its
// transactions, never in process memory.
type Store interface {
	// BeginClaim opens a transaction with opts and, inside it, inserts c unless a row with the
	// same (MessageID, ConsumerName) exists, without a prior read (insert-first, so two
	// concurrent claims serialise on the unique key: the second waits for the first to commit
	// or roll back). In both cases the returned Tx is open and usable: a duplicate must not
	// abort the transaction. On error no transaction is left open.
	BeginClaim(ctx context.Context, opts TxOptions, c Claim) (Tx, ClaimResult, error)

	// Retryable reports whether err (from BeginClaim, from the handler's statements in the
	// transaction, or from Commit) is a transient conflict after which the whole transaction,
	// claim included, can be retried: on PostgreSQL SQLSTATE 40001 (serialization_failure) and
	// 40P01 (deadlock_detected). The transaction is known to have rolled back.
	Retryable(err error) bool

	// RecordFailure stores errText as the last error of the key's attempt record (the store
	// truncates it). It never stores payloads; callers pass error strings only.
	RecordFailure(ctx context.Context, messageID, consumerName, errText string) error

	// MarkDeadLettered records that the key was published to the dead-letter topic, with the
	// reason. Later BeginClaim calls with CountAttempt report DeadLettered until Replay.
	MarkDeadLettered(ctx context.Context, messageID, consumerName, reason string) error

	// Replay clears the dead-lettered state and attempt count of a key, so its next delivery
	// runs the handler again. It reports whether the key was dead-lettered.
	Replay(ctx context.Context, messageID, consumerName string) (bool, error)
}

// Tx is an open inbox transaction. Exactly one of Commit or Rollback must be called; both
// release the underlying connection. Rollback after Commit is a no-op.
type Tx interface {
	// Context returns ctx carrying the store's native transaction, so the handler's business
	// writes join it (for the pgx store: pgstore.TxFromContext).
	Context(ctx context.Context) context.Context
	// Commit commits the claim and everything written in the transaction. An error wrapping
	// ErrCommitRolledBack means the server rolled the transaction back; any other non-nil
	// error means the outcome may be unknown (the connection broke after COMMIT was sent):
	// the caller must not ack, and the redelivery will resolve as a duplicate if it did
	// commit.
	Commit(ctx context.Context) error
	// Rollback discards the transaction. It returns nil when the transaction is already closed.
	Rollback(ctx context.Context) error
}

// Outbox stores the messages a handler returns inside the inbox transaction, so they commit
// or roll back with the claim and the business writes; a relay publishes them to the broker
// after the commit (package outbox). Without an Outbox the inbox refuses handler output
// (ErrProducedMessages).
type Outbox interface {
	// Store writes msgs, destined for topic, in the transaction that ctx carries (the inbox
	// transaction, from Tx.Context). Their UUIDs and metadata must be kept.
	Store(ctx context.Context, topic string, msgs []*message.Message) error
}
