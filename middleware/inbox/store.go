package inbox

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
)

// Store is the storage an Inbox claims on: a *pgstore.Store (PostgreSQL with pgx v5). Its
// methods are this module's internal storage contract (docs/design.md, "The storage
// contract"), sealed as River seals its driver interface: the stores ship with this module,
// and a Store cannot be implemented outside it.
type Store = contract.Store

// Key is the inbox's unique key: one message (MessageID, the producer's message ID or a
// business idempotency key) for one consumer (ConsumerName). Result carries it.
type Key = contract.Key

// ErrCommitRolledBack is wrapped by a commit error when the transaction certainly did not
// commit: PostgreSQL answered COMMIT with ROLLBACK (a statement of the handler had failed),
// COMMIT raised an error (a deferred constraint), or the handler had ended the transaction
// (ErrTxEnded). The delivery is the message's failure. A commit error without it has an
// unknown outcome: the inbox nacks and never dead-letters, since the redelivery tells.
var ErrCommitRolledBack = contract.ErrCommitRolledBack

// ErrTxEnded is the failure of a delivery whose handler ended the inbox transaction it was
// given, or tried to (Commit or Rollback on it, a COMMIT or ROLLBACK statement, a closed
// connection): nacked, never acked, since what it wrote may be gone. It also wraps
// ErrCommitRolledBack.
var ErrTxEnded = contract.ErrTxEnded

// Outbox stores the messages a handler returns inside the inbox transaction, so they commit or
// roll back with the claim and the business writes; a relay publishes them after the commit
// (package outbox). Without an Outbox the inbox refuses handler output (ErrProducedMessages).
type Outbox interface {
	// Store writes msgs, destined for topic, in the inbox transaction that ctx carries (the
	// handler's context: pgstore.TxFromContext finds it), keeping their UUIDs and metadata.
	Store(ctx context.Context, topic string, msgs []*message.Message) error
}
