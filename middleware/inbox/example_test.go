package inbox_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// Example wraps a handler with the inbox on PostgreSQL: the handler's writes go through the
// inbox transaction, so a payment delivered three times, as an at-least-once broker may,
// moves the balance once. (With a Watermill router, add ib.Middleware to the handler, or use
// package router, which does it for you.)
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL")) // e.g. postgres://app@localhost/app
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := pgstore.New(pool, pgstore.Config{}) // table public.inbox_processed_messages
	if err != nil {
		log.Fatal(err)
	}
	if _, err := store.Migrate(ctx); err != nil { // or run store.MigrationSQL() yourself
		log.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing"}, nil)
	if err != nil {
		log.Fatal(err)
	}
	credit := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := pgstore.TxFromContext(msg.Context()) // the inbox transaction
		_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 100 WHERE id = 1")
		return nil, err
	})
	for range 3 { // one message, delivered three times
		msg := message.NewMessage("3f6c2a9e-8b1d-4e7a-9c55-0d2f1b7e4a10", []byte(`{"amount":100}`))
		msg.SetContext(ctx)
		if _, err := credit(msg); err != nil {
			log.Fatal(err)
		}
	}
	s := ib.Stats()
	fmt.Printf("processed=%d duplicates=%d\n", s.Processed, s.Duplicates)
}

// Example_observer runs the inbox on the in-memory reference store (storetest.MemStore, for
// tests only: it guarantees nothing across processes) and reports each delivery's outcome
// through Config.Observer, the hook metrics and tracing attach to.
func Example_observer() {
	store := storetest.NewMemStore()
	observer := inbox.ObserverFunc(func(_ context.Context, r inbox.Result) {
		fmt.Printf("%s %s\n", r.Key.MessageID, r.Outcome)
	})
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing", Observer: observer}, nil)
	if err != nil {
		log.Fatal(err)
	}
	credit := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := storetest.MemTxFromContext(msg.Context())
		tx.Add("balance", 100)
		return nil, nil
	})
	for _, id := range []string{"pay-1", "pay-1", "pay-2", ""} {
		msg := message.NewMessage(id, []byte(`{"amount":100}`))
		_, _ = credit(msg)
	}
	fmt.Println("balance", store.Value("balance"))
	// Output:
	// pay-1 processed
	// pay-1 duplicate
	// pay-2 processed
	//  failed_final
	// balance 200
}
