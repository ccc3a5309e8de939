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

// Outbox stores the messages a handler returns inside the inbox transaction, so they commit or
// roll back with the claim and the business writes; a relay publishes them after the commit
// (package outbox). Without an Outbox the inbox refuses handler output (ErrProducedMessages).
type Outbox interface {
	// Store writes msgs, destined for topic, in the inbox transaction that ctx carries (the
	// handler's context: pgstore.TxFromContext finds it), keeping their UUIDs and metadata.
	Store(ctx context.Context, topic string, msgs []*message.Message) error
}
