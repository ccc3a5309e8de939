// Package deferred is the store-then-process inbox: on receipt a message is only stored (with
// status pending; the unique key on (message ID, consumer name) drops duplicates), committed
// and acked; workers later claim pending rows with FOR UPDATE SKIP LOCKED, run the business
// handler in the row's transaction and mark the row done in the same commit. It serves
// handlers slower than the broker's ack window, replay of stored payloads, and ordering per
// aggregate. docs/store-then-process.md explains the model, the states, the ordering rule and
// the fencing; the immediate inbox (package middleware/inbox) remains the default mode.
//
//	ib, _ := deferred.New(deferred.Config{Pool: pool, ConsumerName: "billing"}, logger)
//	_, _ = ib.Migrate(ctx)
//	router.AddConsumerHandler("billing", "payments", sub, ib.Receive) // receipt: store, ack
//	w := ib.NewConsumerWorkers(func(msg *message.Message) error {     // the same handler
//		tx, _ := pgstore.TxFromContext(msg.Context())
//		_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 10 WHERE id = 1")
//		return err
//	})
//	go w.Run(ctx)
package deferred
