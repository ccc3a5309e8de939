package sqlstore_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/sqlstore"
)

// Example wraps a handler with the inbox on MariaDB through database/sql: the handler's
// writes go through the inbox's *sql.Tx, so a payment delivered three times moves the
// balance once.
func Example() {
	ctx := context.Background()
	db, err := sqlstore.Open(ctx, sqlstore.MySQL, os.Getenv("MYSQL_DSN")) // e.g. app:secret@tcp(localhost:3306)/app
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = db.Close() }()
	db.SetMaxOpenConns(16) // the subscriber's concurrency plus a few
	store, err := sqlstore.New(db, sqlstore.Config{Dialect: sqlstore.MySQL})
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
		tx, _ := sqlstore.TxFromContext(msg.Context()) // the inbox transaction
		_, err := tx.ExecContext(msg.Context(), "UPDATE accounts SET balance = balance + 100 WHERE id = 1")
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
