package middleware

import (
	"context"
	"database/sql"
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
}

// Store is the inbox's storage: it opens a transaction and claims a message in it. It is
// deliberately narrow, so other databases can implement it; every implementation must pass
// the conformance suite in package storetest.
//
// The guarantee lives in the store's unique key on (message_id, consumer_name) and in its
// transactions, never in process memory.
type Store interface {
	// BeginClaim opens a transaction with opts and, inside it, inserts c unless a row with the
	// same (MessageID, ConsumerName) exists, without a prior read (insert-first, so two
	// concurrent claims serialise on the unique key: the second waits for the first to commit
	// or roll back). claimed is true when this transaction inserted the row, false when the
	// row already exists (a duplicate). In both cases the returned Tx is open and usable: a
	// duplicate must not abort the transaction. On error no transaction is left open.
	BeginClaim(ctx context.Context, opts TxOptions, c Claim) (tx Tx, claimed bool, err error)

	// Retryable reports whether err (from BeginClaim, from the handler's statements in the
	// transaction, or from Commit) is a transient conflict after which the whole transaction,
	// claim included, can be retried: on PostgreSQL SQLSTATE 40001 (serialization_failure) and
	// 40P01 (deadlock_detected). The transaction is known to have rolled back.
	Retryable(err error) bool
}

// Tx is an open inbox transaction. Exactly one of Commit or Rollback must be called; both
// release the underlying connection. Rollback after Commit is a no-op.
type Tx interface {
	// Context returns ctx carrying the store's native transaction, so the handler's business
	// writes join it (for the pgx store: pgstore.TxFromContext).
	Context(ctx context.Context) context.Context
	// Commit commits the claim and everything written in the transaction. A non-nil error
	// means the outcome may be unknown (the connection broke after COMMIT was sent): the
	// caller must not ack, and the redelivery will resolve as a duplicate if it did commit.
	Commit(ctx context.Context) error
	// Rollback discards the transaction. It returns nil when the transaction is already closed.
	Rollback(ctx context.Context) error
}
