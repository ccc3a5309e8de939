// Package inbox is the transactional inbox for Watermill: a router middleware that makes
// a handler an idempotent consumer, so each message's effects are applied exactly once in
// PostgreSQL although the broker delivers it at least once.
//
//	import (
//		"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
//		"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
//	)
//
//	store, err := pgstore.New(pool, pgstore.Config{})        // public.inbox_processed_messages
//	if _, err := store.Migrate(ctx); err != nil { ... }       // or run store.MigrationSQL() yourself
//	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing"}, logger)
//
//	h := router.AddConsumerHandler("billing", "payments", subscriber, func(msg *message.Message) error {
//		tx, _ := pgstore.TxFromContext(msg.Context()) // the inbox transaction
//		_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + $1 WHERE id = $2", amount, id)
//		return err
//	})
//	h.AddMiddleware(ib.Middleware) // add it last: Watermill nests middleware in the order added
//
// Per delivery the inbox opens one transaction and, in this order: claims the producer's
// message ID for the consumer with INSERT ... ON CONFLICT DO NOTHING on the
// (message_id, consumer_name) primary key; runs the handler with that transaction in
// msg.Context(); commits; and only then returns, so the router acks after the commit. A claim
// that inserts no row is a duplicate: the handler is skipped and the router acks. A crash
// before the commit leaves nothing behind and the broker's redelivery does the work; a crash
// after the commit and before the ack is redelivered and skipped as a duplicate.
//
// The guarantee covers only writes made through the inbox transaction. Calls to other
// systems (HTTP, e-mail, another database, publishing to a broker) are not rolled back and
// may repeat on redelivery; see docs/design.md in the repository.
//
// The storage contract (Store, Tx, and the optional AttemptStore, Purger and FaultClassifier)
// is at version 2 and may still change before 1.0; package storetest holds its conformance
// suite and MemStore, the in-memory reference store. docs/design.md draws the packages and
// one delivery's path.
package inbox
