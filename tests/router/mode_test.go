package router_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/routertest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestModeFromConfig: one handler, unchanged, runs in both modes on NATS JetStream; only
// Config.Mode differs. Each run asserts the ledger (two rows for three deliveries, one a
// duplicate) and, in store-then-process, that the rows are done.
func TestModeFromConfig(t *testing.T) {
	url := testenv.RequireNATS(t)
	for _, mode := range []string{"", router.ModeStoreThenProcess} {
		t.Run("mode="+mode, func(t *testing.T) {
			sch := testenv.NewSchema(t, 8)
			ctx := context.Background()
			store := sch.Store(t)
			sch.Exec(t, "CREATE TABLE ledger (message_id text PRIMARY KEY)")
			cfg := router.Config{Broker: "nats", URL: url, Mode: mode}
			r, err := router.New(cfg, sch.Pool, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			topic := "modes_" + sch.Name
			t.Cleanup(func() { routertest.DeleteTopic(t, cfg, topic) })
			dcfg := deferred.Config{Schema: sch.Name, PollInterval: 100 * time.Millisecond}
			if mode != "" {
				dcfg.Pool = sch.Pool
				d, err := deferred.New(deferred.Config{Pool: sch.Pool, Schema: sch.Name, ConsumerName: "ledger"}, nil)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := d.Migrate(ctx); err != nil {
					t.Fatal(err)
				}
			}
			ib, _, err := r.AddModeConsumer(inbox.Config{Store: store, ConsumerName: "ledger"}, dcfg, topic, func(msg *message.Message) error {
				tx, _ := pgstore.TxFromContext(msg.Context()) // the handler, identical in both modes
				_, err := tx.Exec(msg.Context(), "INSERT INTO ledger VALUES ($1)", msg.UUID)
				return err
			}, nil)
			if err != nil {
				t.Fatal(err)
			}
			go func() { _ = r.Run(ctx) }()
			<-r.Running()
			for _, id := range []string{"e-1", "e-2", "e-1"} {
				if err := r.Broker.Publisher.Publish(topic, message.NewMessage(id, []byte(`{}`))); err != nil {
					t.Fatal(err)
				}
			}
			// The inboxes count a delivery after its transaction committed, so the ledger rows
			// show before the counters do: wait for both, then give the duplicate time to
			// (wrongly) add a row.
			counted := func() bool {
				switch ib := ib.(type) {
				case *inbox.Inbox:
					return ib.Stats().Processed >= 2
				case *deferred.Inbox:
					return ib.Counters().Done >= 2
				}
				return true
			}
			var n int
			deadline := time.Now().Add(20 * time.Second)
			for time.Now().Before(deadline) {
				_ = sch.Pool.QueryRow(ctx, "SELECT count(*) FROM ledger").Scan(&n)
				if n == 2 && counted() {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			time.Sleep(200 * time.Millisecond)
			_ = sch.Pool.QueryRow(ctx, "SELECT count(*) FROM ledger").Scan(&n)
			if n != 2 {
				t.Fatalf("ledger rows %d, want 2", n)
			}
			switch ib := ib.(type) {
			case *inbox.Inbox:
				if mode != "" || ib.Stats().Processed != 2 {
					t.Fatalf("mode %q: immediate inbox stats %+v", mode, ib.Stats())
				}
			case *deferred.Inbox:
				st, err := ib.Stats(ctx)
				if mode != router.ModeStoreThenProcess || err != nil || st.Counters.Done != 2 || st.Pending != 0 {
					t.Fatalf("mode %q: deferred stats %+v %v", mode, st, err)
				}
			default:
				t.Fatalf("AddModeConsumer returned %T", ib)
			}
		})
	}
}

// TestModeConfigErrors: an unknown mode is refused, naming the setting.
func TestModeConfigErrors(t *testing.T) {
	t.Setenv("INBOX_MODE", "later")
	if _, err := router.ConfigFromEnv(); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("INBOX_MODE=later: %v", err)
	}
	t.Setenv("INBOX_MODE", "Store-Then-Process")
	cfg, err := router.ConfigFromEnv()
	if err != nil || cfg.Mode != router.ModeStoreThenProcess {
		t.Fatalf("INBOX_MODE=Store-Then-Process: %+v %v", cfg, err)
	}
}

// TestModeHandlerFromConfig: AddModeHandler runs one handler that returns a message, unchanged,
// in both modes on NATS JetStream: each of two unique deliveries (of three, one a duplicate)
// writes a ledger row and stores its returned message through the outbox in the same
// transaction: two ledger rows and two outbox rows (forwarder envelopes; the handler is the
// only writer of the outbox).
func TestModeHandlerFromConfig(t *testing.T) {
	url := testenv.RequireNATS(t)
	for _, mode := range []string{router.ModeImmediate, router.ModeStoreThenProcess} {
		t.Run("mode="+mode, func(t *testing.T) {
			sch := testenv.NewSchema(t, 8)
			ctx := context.Background()
			sch.Exec(t, "CREATE TABLE ledger (message_id text PRIMARY KEY)")
			ocfg := outbox.Config{Schema: sch.Name}
			if err := outbox.InitializeSchema(ctx, sch.Pool, ocfg); err != nil {
				t.Fatal(err)
			}
			ob, err := outbox.New(ocfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			cfg := router.Config{Broker: "nats", URL: url, Mode: mode}
			r, err := router.New(cfg, sch.Pool, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			topic := "modeh_" + sch.Name
			t.Cleanup(func() { routertest.DeleteTopic(t, cfg, topic) })
			dcfg := deferred.Config{Schema: sch.Name, PollInterval: 100 * time.Millisecond}
			if mode == router.ModeStoreThenProcess {
				d, err := deferred.New(deferred.Config{Pool: sch.Pool, Schema: sch.Name, ConsumerName: "ledger"}, nil)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := d.Migrate(ctx); err != nil {
					t.Fatal(err)
				}
			}
			ib, _, err := r.AddModeHandler(inbox.Config{Store: sch.Store(t), ConsumerName: "ledger", Outbox: ob}, dcfg, topic, "receipts",
				func(msg *message.Message) ([]*message.Message, error) {
					tx, _ := pgstore.TxFromContext(msg.Context()) // the handler, identical in both modes
					if _, err := tx.Exec(msg.Context(), "INSERT INTO ledger VALUES ($1)", msg.UUID); err != nil {
						return nil, err
					}
					return []*message.Message{message.NewMessage("receipt-"+msg.UUID, []byte(`{}`))}, nil
				}, nil)
			if err != nil {
				t.Fatal(err)
			}
			switch ib.(type) {
			case *inbox.Inbox:
				if mode != router.ModeImmediate {
					t.Fatalf("mode %q: AddModeHandler returned an immediate inbox", mode)
				}
			case *deferred.Inbox:
				if mode != router.ModeStoreThenProcess {
					t.Fatalf("mode %q: AddModeHandler returned a deferred inbox", mode)
				}
			default:
				t.Fatalf("AddModeHandler returned %T", ib)
			}
			go func() { _ = r.Run(ctx) }()
			<-r.Running()
			for _, id := range []string{"h-1", "h-2", "h-1"} {
				if err := r.Broker.Publisher.Publish(topic, message.NewMessage(id, []byte(`{}`))); err != nil {
					t.Fatal(err)
				}
			}
			outboxRows := func() (n int) {
				_ = sch.Pool.QueryRow(ctx, `SELECT count(*) FROM watermill_inbox_outbox`).Scan(&n)
				return n
			}
			var n int
			deadline := time.Now().Add(20 * time.Second)
			for time.Now().Before(deadline) {
				_ = sch.Pool.QueryRow(ctx, "SELECT count(*) FROM ledger").Scan(&n)
				if n == 2 && outboxRows() == 2 {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			time.Sleep(200 * time.Millisecond)
			_ = sch.Pool.QueryRow(ctx, "SELECT count(*) FROM ledger").Scan(&n)
			if o := outboxRows(); n != 2 || o != 2 {
				t.Fatalf("ledger rows %d, outbox rows %d; want 2 and 2", n, o)
			}
		})
	}
}
