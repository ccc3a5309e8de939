package router_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestStoreThenProcessPerDatabase: in the store-then-process mode an inbox.Config with Stores
// gets a deferred inbox per database. Payments for tenants a and b (one a duplicate, and one
// UUID used on both databases) go through the router; each database's balances hold each of
// its own payments once and nothing of the other's, and its deferred rows are done. A message
// with an unknown route or none is dead-lettered with the *inbox.RouteError; a third database,
// dropped before the router runs, stops neither the others' receipts nor their workers.
func TestStoreThenProcessPerDatabase(t *testing.T) {
	dbA, dbB, dbC := testenv.NewDatabase(t, 8), testenv.NewDatabase(t, 8), testenv.NewDatabase(t, 4)
	dbA.CreateAccounts(t, 2)
	dbB.CreateAccounts(t, 2)
	route, err := inbox.RouteFromMetadata("tenant")
	if err != nil {
		t.Fatal(err)
	}
	r, err := router.New(router.Config{Broker: "fake", Mode: router.ModeStoreThenProcess}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dead, err := r.Broker.Subscriber.Subscribe(ctx, "payments_dead")
	if err != nil {
		t.Fatal(err)
	}
	shared := dbA.Store(t) // two routes on one database share its deferred inbox
	icfg := inbox.Config{ConsumerName: "billing", Route: route,
		Stores:              map[string]inbox.Store{"a": shared, "a2": shared, "b": dbB.Store(t), "c": dbC.Store(t)},
		DeadLetterPublisher: r.Broker.Publisher, DeadLetterTopic: "payments_dead"}
	got, _, err := r.AddModeConsumer(icfg, deferred.Config{PollInterval: 100 * time.Millisecond}, "payments", credit, nil)
	if err != nil {
		t.Fatal(err)
	}
	inboxes, ok := got.(map[string]*deferred.Inbox)
	if !ok || len(inboxes) != 4 || inboxes["a"] != inboxes["a2"] || inboxes["a"] == inboxes["b"] || inboxes["b"] == inboxes["c"] {
		t.Fatalf("AddModeConsumer returned %T %v, want a map of 4 routes over 3 deferred inboxes", got, got)
	}
	for _, name := range []string{"a", "b", "c"} {
		if _, err := inboxes[name].Migrate(ctx); err != nil {
			t.Fatalf("migrate %s: %v", name, err)
		}
	}
	dropDatabase(t, dbC.DBName)

	go func() { _ = r.Run(ctx) }()
	<-r.Running()
	for _, m := range []struct {
		id, tenant      string
		account, amount int
	}{
		{"p-1", "a", 1, 100}, {"p-2", "a2", 2, 20}, {"p-1", "a", 1, 100}, // the last a duplicate
		{"p-1", "b", 1, 7}, {"p-3", "b", 1, 5}, // p-1 again, on its own database
		{"p-4", "nowhere", 1, 1000}, {"p-5", "", 1, 1000}, // no store: dead-lettered
	} {
		msg := message.NewMessage(m.id, []byte(fmt.Sprintf(`{"account":%d,"amount":%d}`, m.account, m.amount)))
		if m.tenant != "" {
			msg.Metadata.Set("tenant", m.tenant)
		}
		if err := r.Broker.Publisher.Publish("payments", msg); err != nil {
			t.Fatal(err)
		}
	}

	reasons := map[string]string{}
	for len(reasons) < 2 {
		select {
		case dl := <-dead:
			reasons[dl.UUID] = dl.Metadata.Get(wmmiddleware.ReasonForPoisonedKey)
			dl.Ack()
		case <-ctx.Done():
			t.Fatalf("dead letters: %v, want p-4 and p-5", reasons)
		}
	}
	if !strings.Contains(reasons["p-4"], "no store for route nowhere: unknown route") ||
		!strings.Contains(reasons["p-5"], `no store for the message: no metadata "tenant"`) {
		t.Errorf("dead-letter reasons %q, want the *inbox.RouteError of each", reasons)
	}

	for _, c := range []struct {
		db       *testenv.Database
		table    string
		balances [2]int64
	}{{dbA, inboxes["a"].Table(), [2]int64{100, 20}}, {dbB, inboxes["b"].Table(), [2]int64{12, 0}}} {
		db, balances := c.db, c.balances
		waitUntil(t, ctx, "the rows of "+db.DBName+" done", func() bool {
			return count(t, db.Pool, "SELECT count(*) FROM "+c.table+" WHERE status = 'done'") == 2
		})
		for i, b := range balances {
			if got := count(t, db.Pool, "SELECT balance FROM accounts WHERE id = $1", i+1); got != b {
				t.Errorf("%s: account %d balance %d, want %d", db.DBName, i+1, got, b)
			}
		}
		if n := count(t, db.Pool, "SELECT count(*) FROM "+c.table+" WHERE status <> 'done'"); n != 0 {
			t.Errorf("%s: %d deferred rows not done", db.DBName, n)
		}
	}
	for name, duplicates := range map[string]uint64{"a": 1, "b": 0} {
		if c := inboxes[name].Counters(); c.Done != 2 || c.Received != 2 || c.Duplicates != duplicates {
			t.Errorf("route %s: counters %+v, want 2 received, 2 done, %d duplicates", name, c, duplicates)
		}
	}
}

// TestStoreThenProcessRefusesStoresItCannotServe: a store that is not a *pgstore.Store has no
// pool for a deferred inbox, and a deferred.Config.Pool beside Stores names no route's
// database: both are refused by a *router.ModeStoresError wrapping inbox.ErrInvalidConfig, and
// nothing is subscribed; the immediate mode takes the first configuration.
func TestStoreThenProcessRefusesStoresItCannotServe(t *testing.T) {
	route, err := inbox.RouteFromMetadata("tenant")
	if err != nil {
		t.Fatal(err)
	}
	icfg := inbox.Config{ConsumerName: "billing", Route: route,
		Stores: map[string]inbox.Store{"a": storetest.NewMemStore(), "b": storetest.NewMemStore()}}
	h := func(*message.Message) error { return nil }

	r, err := router.New(router.Config{Broker: "fake", Mode: router.ModeStoreThenProcess}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	_, _, errConsumer := r.AddModeConsumer(icfg, deferred.Config{}, "payments", h, nil)
	_, _, errHandler := r.AddModeHandler(icfg, deferred.Config{}, "payments", "receipts",
		func(*message.Message) ([]*message.Message, error) { return nil, nil }, nil)
	_, _, errNoRoute := r.AddModeConsumer(inbox.Config{ConsumerName: "billing", Stores: icfg.Stores}, deferred.Config{}, "payments", h, nil)
	for _, err := range []error{errConsumer, errHandler, errNoRoute} {
		var mse *router.ModeStoresError
		if !errors.As(err, &mse) || !errors.Is(err, inbox.ErrInvalidConfig) || mse.Routes != 2 || mse.Mode != router.ModeStoreThenProcess {
			t.Errorf("store-then-process with Stores it cannot serve: err = %v, want a *ModeStoresError (2 routes) wrapping inbox.ErrInvalidConfig", err)
		}
	}
	if errConsumer == nil || !strings.Contains(errConsumer.Error(), "is not a *pgstore.Store") {
		t.Errorf("memory stores: %v", errConsumer)
	}
	if n := len(r.Handlers()); n != 0 {
		t.Errorf("the refused configurations added %d handlers, want 0", n)
	}

	imm, err := router.New(router.Config{Broker: "fake"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer imm.Close()
	if _, _, err := imm.AddModeConsumer(icfg, deferred.Config{}, "payments", h, nil); err != nil {
		t.Errorf("immediate mode with Stores: %v", err)
	}
}

// credit is the business handler: it credits the payment to its account in the row's
// transaction, on the database the row was stored in.
func credit(msg *message.Message) error {
	tx, ok := pgstore.TxFromContext(msg.Context())
	if !ok {
		return errors.New("no transaction in the context")
	}
	var p struct{ Account, Amount int }
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return err
	}
	_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + $1 WHERE id = $2", p.Amount, p.Account)
	return err
}

// dropDatabase drops the named database now, closing its connections: that database is down.
func dropDatabase(t *testing.T, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, testenv.DatabaseURL())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, "DROP DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		t.Fatal(err)
	}
}

// count returns a single integer from q.
func count(t *testing.T, pool *pgxpool.Pool, q string, args ...any) int64 {
	t.Helper()
	var n int64
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := pool.QueryRow(ctx, q, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return n
}

// waitUntil polls cond every 20 ms until it holds, failing t when ctx ends.
func waitUntil(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(20 * time.Millisecond):
		}
	}
}
