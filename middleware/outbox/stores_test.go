package outbox_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
)

// TestStoresOutboxPerDatabaseOneRelayEach runs one consumer over two databases (a database
// per tenant, inbox.Config.Stores) with one Outbox: each handler's messages are written to the
// outbox of the database its transaction is on, and a relay per database (a RelayConfig on
// that database's pool) relays each message exactly once. Duplicates produce nothing again,
// and the same message ID in both tenants is processed once on each database.
func TestStoresOutboxPerDatabaseOneRelayEach(t *testing.T) {
	tenants := []string{"a", "b"}
	cfg := outbox.Config{}
	dbs, stores := map[string]*testenv.Database{}, map[string]inbox.Store{}
	for _, name := range tenants {
		db := testenv.NewDatabase(t, 6)
		db.CreateAccounts(t, 10)
		if err := outbox.InitializeSchema(t.Context(), db.Pool, cfg); err != nil {
			t.Fatal(err)
		}
		dbs[name], stores[name] = db, db.Store(t)
	}
	ob, err := outbox.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	route, err := inbox.RouteFromMetadata("tenant")
	if err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{Stores: stores, Route: route, ConsumerName: "billing", Outbox: ob}, nil)
	if err != nil {
		t.Fatal(err)
	}

	in := newGoChannel()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	h := router.AddHandler("billing", "payments", in, "billing.events", &refusingPublisher{}, func(msg *message.Message) ([]*message.Message, error) {
		if err := credit(msg); err != nil {
			return nil, err
		}
		out := produced(msg)
		for _, m := range out {
			m.Metadata.Set("tenant", msg.Metadata.Get("tenant"))
		}
		return out, nil
	})
	h.AddMiddleware(ib.Middleware)
	runRouter(t, router)

	ids := map[string][]string{"a": {"pay-1", "pay-2", "shared"}, "b": {"pay-3", "shared"}}
	for _, name := range tenants {
		for k, id := range ids[name] {
			for range 2 { // every message delivered twice
				m := paymentMsg(id, k+1, int64(len(name)*100+k))
				m.Metadata.Set("tenant", name)
				publishAcked(t, in, "payments", m)
			}
		}
	}
	for _, name := range tenants {
		var n int64
		if err := dbs[name].Pool.QueryRow(t.Context(), "SELECT count(*) FROM "+cfg.MessagesTable()).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if want := int64(2 * len(ids[name])); n != want {
			t.Fatalf("outbox rows in tenant %s's database = %d, want %d (two per message of its own)", name, n, want)
		}
	}

	// One relay per database, all publishing to one broker.
	relayed := newGoChannel()
	events, err := relayed.Subscribe(t.Context(), "billing.events")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range tenants {
		startRelay(t, outbox.RelayConfig{Config: cfg, Pool: dbs[name].Pool, Publisher: relayed, PollInterval: 20 * time.Millisecond})
	}
	want := 0
	for _, name := range tenants {
		want += 2 * len(ids[name])
	}
	got := map[string]int{}
	for _, m := range collect(t, events, want, 10*time.Second) {
		got[m.Metadata.Get("tenant")+" "+m.UUID]++
	}
	// Nothing more: wait a few polls for a second copy.
	select {
	case m := <-events:
		m.Ack()
		t.Fatalf("relayed once more: %s of tenant %s", m.UUID, m.Metadata.Get("tenant"))
	case <-time.After(300 * time.Millisecond):
	}
	for _, name := range tenants {
		for _, id := range ids[name] {
			for i := 1; i <= 2; i++ {
				if k := fmt.Sprintf("%s %s/%d", name, id, i); got[k] != 1 {
					t.Errorf("relayed %q %d times, want 1 (got %v)", k, got[k], got)
				}
			}
		}
	}
	if len(got) != want {
		t.Errorf("relayed %d distinct messages, want %d: %v", len(got), want, got)
	}
}
