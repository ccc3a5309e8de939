// Command quickstart is the README's quick start: a consumer on the postgres broker (PostgreSQL
// is the database and the broker, nothing else to run), one message published twice, processed
// once.
//
//	DATABASE_URL=postgres://postgres@127.0.0.1:5432/test go run ./examples/quickstart
package main

import (
	"context"
	"log"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	_ "github.com/watermill-inbox/watermill-inbox/adapters/postgres" // registers the "postgres" broker
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

func main() {
	ctx, stop := context.WithTimeout(context.Background(), time.Minute)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	store, err := pgstore.New(pool, pgstore.Config{}) // the inbox tables, in schema public
	check(err)
	_, err = store.Migrate(ctx) // or `watermill-inbox migrate`, as the schema's owner
	check(err)
	_, err = pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS greetings (message_id text PRIMARY KEY)")
	check(err)

	r, err := router.New(router.Config{Broker: "postgres"}, pool, nil) // or router.ConfigFromEnv()
	check(err)
	defer r.Close()
	ib, err := r.NewInbox(inbox.Config{Store: store, ConsumerName: "greeter"}, nil)
	check(err)
	_, err = r.AddConsumer(ib, "greetings", func(msg *message.Message) error {
		tx, _ := pgstore.TxFromContext(msg.Context()) // the inbox's transaction: commits with the claim
		_, err := tx.Exec(msg.Context(), "INSERT INTO greetings VALUES ($1)", msg.UUID)
		return err
	})
	check(err)

	go func() {
		<-r.Running()
		for range 2 { // the same message ID twice: a redelivery, as any broker may make
			check(r.Broker.Publisher.Publish("greetings", message.NewMessage("hello-1", []byte("hi"))))
		}
		for s := ib.Stats(); s.Processed+s.Duplicates < 2; s = ib.Stats() {
			time.Sleep(10 * time.Millisecond)
		}
		log.Printf("processed %d, skipped %d duplicate", ib.Stats().Processed, ib.Stats().Duplicates)
		stop()
	}()
	check(r.Run(ctx))
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
