// Package outbox is the transactional outbox for the messages an inbox-wrapped handler
// returns, built from Watermill's own components: a watermill-sql v4 Publisher on the inbox's
// pgx transaction, decorated by components/forwarder's Publisher, writes them; a
// components/forwarder Forwarder reading the outbox with a watermill-sql Subscriber publishes
// them to the broker after the commit.
//
//	cfg := outbox.Config{}                                       // topic "inbox_outbox"
//	if err := outbox.InitializeSchema(ctx, pool, cfg); err != nil { ... }
//	ob, _ := outbox.New(cfg, logger)
//	ib, _ := inbox.New(inbox.Config{Store: store, ConsumerName: "billing", Outbox: ob}, logger)
//
//	h := router.AddHandler("billing", "payments", sub, "billing.events", pub,
//		func(msg *message.Message) ([]*message.Message, error) {
//			tx, _ := pgstore.TxFromContext(msg.Context())
//			// ... business writes on tx ...
//			return []*message.Message{event}, nil // stored in the outbox, in tx
//		})
//	h.AddMiddleware(ib.Middleware)
//
//	relay, _ := outbox.NewRelay(outbox.RelayConfig{Config: cfg, Pool: pool, Publisher: amqpPub}, logger)
//	go relay.Run(ctx)
//
// # Writing
//
// The inbox calls Outbox.Store inside its transaction with the handler's publish topic (the
// topic given to router.AddHandler) and the returned messages; the router gets no messages to
// publish. Each message is wrapped in forwarder's JSON envelope {destination_topic, uuid,
// payload, metadata} and inserted as one row of the outbox topic's table. The rows commit with
// the claim and the business writes, or roll back with them: a failed attempt leaves none,
// and a duplicate delivery, which skips the handler, produces none again.
//
// # Relaying, and its guarantee
//
// The Relay is forwarder's router handler on a watermill-sql Subscriber. Per poll the
// subscriber opens a REPEATABLE READ transaction, locks its consumer group's offset row
// (SELECT ... FOR UPDATE), reads up to BatchSize rows in commit order and hands them to the
// forwarder one at a time. The forwarder unwraps each and starts its publish to its
// destination topic; up to RelayConfig.MaxInFlight publishes wait for the broker's
// confirmation at once (a RabbitMQ publisher confirm, a Kafka produce response, a JetStream
// PubAck), so the relay pays a broker round trip per MaxInFlight messages, not per message.
// Before the transaction commits the last offset, every publish of the batch must have been
// confirmed; when one failed, the transaction rolls back and the whole batch is read and
// published again after ResendInterval. With MaxInFlight 1 the relay publishes one row at a
// time and retries a failed publish before any later row (strict table order).
//
// Delivery to the broker is at least once. A crash, a lost connection, an expired
// AckDeadline or a failed publish between a publish and that commit leaves the offset where
// it was: the next poll, by this relay or another, publishes the same messages again, with
// the same UUIDs, payloads and metadata. Consume them with an inbox (keyed on the message
// UUID, the default) and each is applied once. Nothing is lost: a row is skipped only once
// its offset is committed after its publish was confirmed.
//
// Order: with MaxInFlight above 1, the publishes of a batch run concurrently and the broker
// may receive them in another order than the table's; RelayConfig.OrderingKey keeps the
// messages of one key (a lane) in table order. A consumer behind an inbox does not need
// order for correctness; competing consumers on the broker side reorder anyway.
//
// Rows the relay cannot read (written into the table by something other than Outbox.Store):
// a metadata column that is not a JSON object of strings is skipped, logged at ERROR with the
// row's offset, counted (RelayStats.MalformedSkipped) and passed to OnMalformedRow; a payload
// that is not a forwarder envelope is reported the same way, then skipped when
// AckWhenCannotUnwrap is set, else the group stops at that row (head-of-line, on purpose)
// and reports it at every retry until the row is fixed or deleted. Never a silent stall.
//
// Progress: Relay.Stats (counters, no I/O), Relay.Lag (pending rows, oldest pending row's
// age, offset gap: one query) and RelayConfig.OnBatch (each committed or rolled-back batch).
// docs/operations.md says how to size and scale the relay.
//
// # What the subscriber's REPEATABLE READ transaction means here
//
//   - The forwarder writes nothing to PostgreSQL, so watermill-sql's known problem of nacked
//     attempts whose writes stay in the subscriber's transaction (ThreeDotsLabs/watermill-sql
//     #224) does not affect the relay. It would affect a RelayConfig.Middlewares function that
//     wrote through sql.TxFromContext: do not.
//   - Rows become visible to the relay only when their transaction_id is below the oldest
//     transaction still running (pg_snapshot_xmin), which is how watermill-sql keeps commit
//     order without skipping rows. Any long transaction in the database, such as a slow
//     handler's inbox transaction or an idle-in-transaction session, therefore delays the
//     relay until it ends. It delays; it does not lose.
//   - The relay keeps its transaction, the offset row lock and a snapshot open while it
//     publishes a batch (AckDeadline per publish), so keep publishes quick and batches small
//     enough. Relays of the same ConsumerGroup serialise on the offset row: a second relay is
//     a hot standby, not extra throughput. When one commits an offset while another waits for
//     the lock, the waiter's poll fails under REPEATABLE READ with SQLSTATE 40001 ("could not
//     serialize access due to concurrent update"). watermill-sql v4.1.2 never sees that error
//     (its Rows interface has no Err), so the poll just looks empty and the waiter polls again
//     after PollInterval: no duplicate, no loss. The relay logs such swallowed errors itself:
//     40001 at debug level, any other at error level.
//   - On Close (or when Run's context ends) the router cancels the subscription context; the
//     relay still stores the offset of the rows already handed to the forwarder, once their
//     publishes are confirmed, with the offset update and COMMIT on a context of their own
//     (bounded by CloseTimeout). A graceful stop republishes at most the row in flight and
//     logs no error.
//
// # On MySQL and MariaDB (sqlstore's MySQL dialect)
//
// With sqlstore.MySQL, Store writes watermill-sql's MySQL queue schema (MySQLQueueSchema) in
// the inbox's *sql.Tx, and a Relay with RelayConfig.MySQL (a *sql.DB) reads it with the
// queue's adapter; InitializeMySQLSchema creates the table:
//
//	if err := outbox.InitializeMySQLSchema(ctx, db, cfg); err != nil { ... }
//	relay, _ := outbox.NewRelay(outbox.RelayConfig{Config: cfg, MySQL: db, Publisher: amqpPub}, logger)
//
// Each poll selects the rows not yet acknowledged in `offset` order (SELECT ... FOR UPDATE
// under SERIALIZABLE, watermill-sql's choice) and deletes the published ones when the batch
// commits, so the table holds only pending rows. Not watermill-sql's offset-based MySQL
// schema: `offset` is AUTO_INCREMENT, assigned when an INSERT starts, so a relay reading
// "offset > the acked offset" could ack past a lower offset whose row was not in the index
// yet and never read it (the billing demo lost 2 receipts of 2000 that way). A row is relayed
// once its transaction committed, and never when it rolled back (TestOutboxOnSQLStoreMySQL in
// package sqlstore). The queue has no consumer groups (RelayConfig.ConsumerGroup must be
// empty): relays on one table take turns on its row locks. A poll that meets a row still
// uncommitted waits for it, so a long inbox transaction that wrote outbox rows stalls the
// relay until it ends, and a poll's next-key locks make other transactions' outbox INSERTs
// wait for it; a deadlock between them (MySQL 1213) is retried, by the inbox or by the relay's
// next poll. The rest of this documentation holds on MySQL too, except what names
// PostgreSQL's snapshots, offsets tables and SQLSTATEs; rows have no transaction id
// (MalformedRow.TransactionID is 0), and GrantSQL and SchemaSQL are PostgreSQL's only:
// MySQLGrantSQL and MySQLSchemaSQL are their MySQL counterparts (`watermill-inbox sql grants
// --dialect mysql --outbox` and `sql migrate --dialect mysql --outbox` print and apply them).
//
// # Schema
//
// InitializeSchema creates the outbox table, "watermill_<topic>", and the relay's offsets
// table, "watermill_offsets_<topic>", with watermill-sql's own statements, in the schema of
// Config.Schema or of the search_path. Envelopes are kept forever: watermill-sql never deletes
// consumed rows, so prune rows below every consumer group's committed offset yourself.
//
// Logs: fields in which Watermill's components log contents (forwarder's "payload" and
// "metadata" on an unwrap failure, watermill-sql's "query_args") are redacted.
package outbox
