package inbox_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// Example delivers the same payment three times, as an at-least-once broker may, and shows
// that the balance moved once.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.DatabaseURL())
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	// A private table for the example, so it can run beside anything else.
	store, err := pgstore.New(pool, pgstore.Config{Table: fmt.Sprintf("example_inbox_%d", os.Getpid())})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	accounts := fmt.Sprintf("example_accounts_%d", os.Getpid())
	if _, err := pool.Exec(ctx, "CREATE TABLE "+accounts+" (id int PRIMARY KEY, balance bigint); INSERT INTO "+accounts+" VALUES (1, 0)"); err != nil {
		log.Fatal(err)
	}
	defer func() {
		_, _ = pool.Exec(ctx, "DROP TABLE "+accounts+", "+store.Table()+", "+store.AttemptsTable())
		_, _ = pool.Exec(ctx, "DELETE FROM watermill_inbox_migrations WHERE table_name = $1", store.Table())
	}()

	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing"}, nil)
	if err != nil {
		log.Fatal(err)
	}
	credit := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := pgstore.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "UPDATE "+accounts+" SET balance = balance + 100 WHERE id = 1")
		return nil, err
	})

	for range 3 { // one message, delivered three times
		msg := message.NewMessage("3f6c2a9e-8b1d-4e7a-9c55-0d2f1b7e4a10", []byte(`{"amount":100}`))
		msg.SetContext(ctx)
		if _, err := credit(msg); err != nil {
			log.Fatal(err)
		}
	}
	var balance int64
	_ = pool.QueryRow(ctx, "SELECT balance FROM "+accounts+" WHERE id = 1").Scan(&balance)
	s := ib.Stats()
	fmt.Printf("balance=%d processed=%d duplicates=%d\n", balance, s.Processed, s.Duplicates)
	// Output: balance=100 processed=1 duplicates=2
}
