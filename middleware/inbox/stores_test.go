package inbox_test

// One consumer over several databases (Config.Stores): three real databases on the local
// PostgreSQL, one store migrated in each.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// tenantDB is one tenant's database: an accounts table and a migrated inbox store.
type tenantDB struct {
	db    *testenv.Database
	store *pgstore.Store
}

// newTenantDBs creates one database per name, each with accounts 1..10 and the inbox tables.
func newTenantDBs(t testing.TB, conns int32, names ...string) map[string]*tenantDB {
	t.Helper()
	out := map[string]*tenantDB{}
	for _, n := range names {
		db := testenv.NewDatabase(t, conns)
		db.CreateAccounts(t, 10)
		out[n] = &tenantDB{db: db, store: db.Store(t)}
	}
	return out
}

func storesOf(dbs map[string]*tenantDB) map[string]inbox.Store {
	out := map[string]inbox.Store{}
	for n, d := range dbs {
		out[n] = d.store
	}
	return out
}

func (d *tenantDB) balance(t testing.TB, account int) int64 {
	t.Helper()
	var b int64
	if err := d.db.Pool.QueryRow(context.Background(), "SELECT balance FROM accounts WHERE id = $1", account).Scan(&b); err != nil {
		t.Fatal(err)
	}
	return b
}

// count runs a count(*) query on d's database.
func (d *tenantDB) count(t testing.TB, q string, args ...any) int {
	t.Helper()
	var n int
	if err := d.db.Pool.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func tenantMsg(tenant, id string, account int, amount int64) *message.Message {
	m := paymentMsg(id, account, amount)
	if tenant != "" {
		m.Metadata.Set("tenant", tenant)
	}
	return m
}

func routeByTenant(t testing.TB) inbox.RouteFunc {
	t.Helper()
	r, err := inbox.RouteFromMetadata("tenant")
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// tenantCredit is the business handler: it credits the payment in the inbox transaction,
// after checking that the transaction is on the database of the message's tenant.
type tenantCredit struct {
	dbName map[string]string // tenant to database name
	mu     sync.Mutex
	runs   map[string]int // handler runs by tenant
	wrong  []string       // messages that ran on another tenant's database
}

func newTenantCredit(dbs map[string]*tenantDB) *tenantCredit {
	c := &tenantCredit{dbName: map[string]string{}, runs: map[string]int{}}
	for n, d := range dbs {
		c.dbName[n] = d.db.DBName
	}
	return c
}

func (c *tenantCredit) handle(msg *message.Message) ([]*message.Message, error) {
	tenant := msg.Metadata.Get("tenant")
	c.mu.Lock()
	c.runs[tenant]++
	c.mu.Unlock()
	tx, ok := pgstore.TxFromContext(msg.Context())
	if !ok {
		return nil, errors.New("no inbox transaction in the context")
	}
	var db string
	if err := tx.QueryRow(msg.Context(), "SELECT current_database()").Scan(&db); err != nil {
		return nil, err
	}
	if db != c.dbName[tenant] {
		c.mu.Lock()
		c.wrong = append(c.wrong, msg.UUID)
		c.mu.Unlock()
	}
	var p payment
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return nil, inbox.Permanent(err)
	}
	_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + $1 WHERE id = $2", p.Amount, p.Account)
	return nil, err
}

// deliverLimited runs every message through h, conc deliveries at a time, and returns the errors
// in msgs' order.
func deliverLimited(h message.HandlerFunc, msgs []*message.Message, conc int) []error {
	errs := make([]error, len(msgs))
	sem := make(chan struct{}, conc)
	var wg sync.WaitGroup
	for k, m := range msgs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			errs[k] = deliver(h, m)
		}()
	}
	wg.Wait()
	return errs
}

// TestStoresOneConsumerSeveralDatabases delivers payments for three tenants, each message
// three times, concurrently, through one consumer whose Stores hold a database per tenant, in
// the immediate and the batched mode: each tenant's database holds exactly its own messages,
// each processed once, its balances changed by its own payments only, and every handler ran on
// its tenant's database.
func TestStoresOneConsumerSeveralDatabases(t *testing.T) {
	for _, mode := range []struct {
		name  string
		batch inbox.BatchConfig
	}{
		{"immediate", inbox.BatchConfig{}},
		{"batched", inbox.BatchConfig{Size: 8, Linger: 5 * time.Millisecond}},
		{"batched-savepoints", inbox.BatchConfig{Size: 8, Linger: 5 * time.Millisecond, Mode: inbox.BatchSavepoints}},
	} {
		t.Run(mode.name, func(t *testing.T) {
			tenants := []string{"a", "b", "c"}
			dbs := newTenantDBs(t, 12, tenants...)
			credit := newTenantCredit(dbs)
			rec := &recorder{}
			ib, err := inbox.New(inbox.Config{Stores: storesOf(dbs), Route: routeByTenant(t), ConsumerName: "billing",
				Batch: mode.batch, Observer: rec}, nil)
			if err != nil {
				t.Fatal(err)
			}
			const perTenant = 15
			want := map[string]map[int]int64{}
			var msgs []*message.Message
			for ti, tenant := range tenants {
				want[tenant] = map[int]int64{}
				for j := range perTenant {
					account, amount := j%10+1, int64((ti+1)*1000+j)
					want[tenant][account] += amount
					for range 3 {
						msgs = append(msgs, tenantMsg(tenant, fmt.Sprintf("%s-pay-%d", tenant, j), account, amount))
					}
				}
				// The same message ID in every tenant: keys are deduplicated per database,
				// so each tenant's database processes its own once.
				want[tenant][1] += int64(ti + 1)
				for range 3 {
					msgs = append(msgs, tenantMsg(tenant, "pay-shared", 1, int64(ti+1)))
				}
			}
			rand.Shuffle(len(msgs), func(a, b int) { msgs[a], msgs[b] = msgs[b], msgs[a] })
			for k, err := range deliverLimited(ib.Middleware(credit.handle), msgs, 32) {
				if err != nil {
					t.Fatalf("delivery %d (%s): %v", k, msgs[k].UUID, err)
				}
			}

			if len(credit.wrong) > 0 {
				t.Fatalf("handlers ran on another tenant's database: %v", credit.wrong)
			}
			for _, tenant := range tenants {
				d := dbs[tenant]
				if n := d.count(t, "SELECT count(*) FROM "+d.store.Table()); n != perTenant+1 {
					t.Errorf("tenant %s: %d inbox rows, want %d", tenant, n, perTenant+1)
				}
				if n := d.count(t, "SELECT count(*) FROM "+d.store.Table()+" WHERE message_id <> 'pay-shared' AND message_id NOT LIKE $1", tenant+"-%"); n != 0 {
					t.Errorf("tenant %s: %d inbox rows of other tenants' messages", tenant, n)
				}
				if n := d.count(t, "SELECT count(*) FROM "+d.store.AttemptsTable()); n != 0 {
					t.Errorf("tenant %s: %d attempt records, want none", tenant, n)
				}
				for account := 1; account <= 10; account++ {
					if got := d.balance(t, account); got != want[tenant][account] {
						t.Errorf("tenant %s account %d: balance %d, want %d (each payment once)", tenant, account, got, want[tenant][account])
					}
				}
				if credit.runs[tenant] < perTenant+1 {
					t.Errorf("tenant %s: %d handler runs, want at least %d", tenant, credit.runs[tenant], perTenant+1)
				}
			}
			st := ib.Stats()
			if st.Processed != 3*(perTenant+1) || st.Duplicates != 6*(perTenant+1) || st.Failed != 0 {
				t.Errorf("stats %+v: want %d processed, %d duplicates", st, 3*(perTenant+1), 6*(perTenant+1))
			}
			rec.mu.Lock()
			defer rec.mu.Unlock()
			for _, r := range rec.results {
				if !strings.HasPrefix(r.Key.MessageID, r.Route+"-") && r.Key.MessageID != "pay-shared" {
					t.Errorf("result of %s has route %q", r.Key.MessageID, r.Route)
				}
			}
		})
	}
}

// TestStoresUnroutableMessages delivers messages without a tenant and with an unknown one:
// each is a *RouteError, permanent; without a dead-letter topic it is returned (nack),
// with one it is dead-lettered with its reason and acked. Nothing is claimed, recorded or
// credited on any database, and the handler never runs.
func TestStoresUnroutableMessages(t *testing.T) {
	dbs := newTenantDBs(t, 4, "a", "b")
	credit := newTenantCredit(dbs)
	bad := []*message.Message{
		tenantMsg("", "pay-no-tenant", 1, 5),
		tenantMsg("zz", "pay-unknown-tenant", 1, 7),
		tenantMsg("A", "pay-wrong-case", 1, 9), // routes are compared exactly
	}

	t.Run("no dead-letter topic", func(t *testing.T) {
		ib, err := inbox.New(inbox.Config{Stores: storesOf(dbs), Route: routeByTenant(t), ConsumerName: "billing"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		h := ib.Middleware(credit.handle)
		for _, m := range bad {
			err := deliver(h, m)
			var re *inbox.RouteError
			if !errors.As(err, &re) || !errors.Is(err, inbox.ErrUnroutable) || !inbox.IsPermanent(err) {
				t.Fatalf("%s: got %v, want a permanent *RouteError", m.UUID, err)
			}
			if strings.Contains(err.Error(), string(m.Payload)) {
				t.Errorf("the error carries the payload: %v", err)
			}
		}
		if st := ib.Stats(); st.Failed != 3 || st.InvalidKeys != 3 {
			t.Errorf("stats %+v: want 3 failed, 3 invalid", st)
		}
	})

	t.Run("dead-letter topic", func(t *testing.T) {
		dlq := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
		t.Cleanup(func() { _ = dlq.Close() })
		ib, err := inbox.New(inbox.Config{Stores: storesOf(dbs), Route: routeByTenant(t), ConsumerName: "billing",
			DeadLetterPublisher: dlq, DeadLetterTopic: "dead"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		h := ib.Middleware(credit.handle)
		for _, m := range bad {
			if err := deliver(h, m); err != nil {
				t.Fatalf("%s: %v, want dead-lettered and acked", m.UUID, err)
			}
		}
		letters, err := dlq.Subscribe(context.Background(), "dead")
		if err != nil {
			t.Fatal(err)
		}
		wantReason := map[string]string{
			"pay-no-tenant":      `no metadata "tenant"`,
			"pay-unknown-tenant": "route zz: unknown route",
			"pay-wrong-case":     "route A: unknown route",
		}
		for range bad {
			select {
			case dl := <-letters:
				dl.Ack()
				if r := dl.Metadata.Get("reason_poisoned"); !strings.Contains(r, wantReason[dl.UUID]) {
					t.Errorf("dead letter %s: reason %q, want it to say %q", dl.UUID, r, wantReason[dl.UUID])
				}
			case <-time.After(5 * time.Second):
				t.Fatal("a dead letter is missing")
			}
		}
		if st := ib.Stats(); st.DeadLettered != 3 {
			t.Errorf("stats %+v: want 3 dead-lettered", st)
		}
	})

	for n, d := range dbs {
		if rows := d.count(t, "SELECT count(*) FROM "+d.store.Table()); rows != 0 {
			t.Errorf("tenant %s: %d inbox rows, want none", n, rows)
		}
		if rows := d.count(t, "SELECT count(*) FROM "+d.store.AttemptsTable()); rows != 0 {
			t.Errorf("tenant %s: %d attempt records, want none", n, rows)
		}
		if b := d.balance(t, 1); b != 0 {
			t.Errorf("tenant %s: balance %d, want 0", n, b)
		}
	}
	if len(credit.runs) != 0 {
		t.Errorf("handler ran: %v", credit.runs)
	}
}

// TestStoresAttemptsAndDeadLettersPerDatabase fails one message of tenant b until it is
// dead-lettered, while a message with the same ID for tenant a is processed: the attempts and
// the dead-lettered state are b's database's only, and ReplayDeadLetter clears them there.
func TestStoresAttemptsAndDeadLettersPerDatabase(t *testing.T) {
	dbs := newTenantDBs(t, 4, "a", "b")
	dlq := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = dlq.Close() })
	ib, err := inbox.New(inbox.Config{Stores: storesOf(dbs), Route: routeByTenant(t), ConsumerName: "billing",
		DeadLetterPublisher: dlq, DeadLetterTopic: "dead", MaxAttempts: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	credit := newTenantCredit(dbs)
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if msg.Metadata.Get("tenant") == "b" {
			return nil, errors.New("tenant b refuses")
		}
		return credit.handle(msg)
	})
	poison := tenantMsg("b", "pay-1", 1, 50)
	if err := deliver(h, poison); err == nil {
		t.Fatal("first attempt: want the handler's error")
	}
	if err := deliver(h, tenantMsg("a", "pay-1", 1, 70)); err != nil {
		t.Fatal(err)
	}
	if err := deliver(h, poison); err != nil {
		t.Fatalf("second attempt: %v, want dead-lettered and acked", err)
	}
	a, b := dbs["a"], dbs["b"]
	if n := b.count(t, "SELECT count(*) FROM "+b.store.AttemptsTable()+" WHERE message_id = 'pay-1' AND attempts = 2 AND dead_lettered_at IS NOT NULL"); n != 1 {
		t.Errorf("tenant b: %d dead-lettered records of pay-1 with 2 attempts, want 1", n)
	}
	if n := a.count(t, "SELECT count(*) FROM "+a.store.AttemptsTable()); n != 0 {
		t.Errorf("tenant a: %d attempt records, want none", n)
	}
	if n := a.count(t, "SELECT count(*) FROM "+a.store.Table()+" WHERE message_id = 'pay-1'"); n != 1 {
		t.Errorf("tenant a: pay-1 processed %d times, want once", n)
	}
	if a.balance(t, 1) != 70 || b.balance(t, 1) != 0 {
		t.Errorf("balances a=%d b=%d, want 70 and 0", a.balance(t, 1), b.balance(t, 1))
	}

	letters, err := dlq.Subscribe(context.Background(), "dead")
	if err != nil {
		t.Fatal(err)
	}
	var dl *message.Message
	select {
	case dl = <-letters:
		dl.Ack()
	case <-time.After(5 * time.Second):
		t.Fatal("no dead letter")
	}
	dl.Metadata.Set("topic_poisoned", "payments") // deliver runs without a router, which names the topic
	republished := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = republished.Close() })
	if err := ib.ReplayDeadLetter(context.Background(), dl, republished); err != nil {
		t.Fatal(err)
	}
	if n := b.count(t, "SELECT count(*) FROM "+b.store.AttemptsTable()); n != 0 {
		t.Errorf("tenant b: %d attempt records after the replay, want none", n)
	}
}

// blackhole listens on loopback and accepts connections that it never answers: a database
// that hangs.
func blackhole(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = l.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return l.Addr().String()
}

// closedPort returns a loopback address nothing listens on: a database that refuses.
func closedPort(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return addr
}

// unreachableStore is a store whose pool points at addr; nothing is connected until a claim.
func unreachableStore(t testing.TB, addr string) *pgstore.Store {
	t.Helper()
	cfg, err := pgxpool.ParseConfig("postgres://postgres@" + addr + "/inbox?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s, err := pgstore.New(pool, pgstore.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// TestStoresOneDatabaseDownOthersFlow makes tenant c's database unreachable (hanging: it
// accepts connections and never answers; refused: nothing listens) and delivers messages for
// c first, then for a and b: a's and b's are processed and acked while c's are still waiting
// (no head-of-line blocking), and c's are nacked, not permanent, not dead-lettered, once
// their claims time out or are refused.
func TestStoresOneDatabaseDownOthersFlow(t *testing.T) {
	const claimTimeout = 4 * time.Second
	for _, fault := range []struct {
		name string
		addr func(testing.TB) string
	}{{"hanging", blackhole}, {"refused", closedPort}} {
		for _, mode := range []struct {
			name  string
			batch inbox.BatchConfig
		}{{"immediate", inbox.BatchConfig{}}, {"batched", inbox.BatchConfig{Size: 8}}} {
			t.Run(fault.name+"/"+mode.name, func(t *testing.T) {
				dbs := newTenantDBs(t, 12, "a", "b")
				stores := storesOf(dbs)
				stores["c"] = unreachableStore(t, fault.addr(t))
				credit := newTenantCredit(dbs)
				dlq := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
				t.Cleanup(func() { _ = dlq.Close() })
				ib, err := inbox.New(inbox.Config{Stores: stores, Route: routeByTenant(t), ConsumerName: "billing",
					ClaimTimeout: claimTimeout, FinishTimeout: claimTimeout,
					DeadLetterPublisher: dlq, DeadLetterTopic: "dead", Batch: mode.batch}, nil)
				if err != nil {
					t.Fatal(err)
				}
				h := ib.Middleware(credit.handle)

				cDone := make(chan []error, 1)
				var cMsgs []*message.Message
				for j := range 8 {
					cMsgs = append(cMsgs, tenantMsg("c", fmt.Sprintf("c-pay-%d", j), 1, 1))
				}
				go func() { cDone <- deliverLimited(h, cMsgs, 8) }()
				time.Sleep(100 * time.Millisecond) // c's deliveries are at their claims

				var msgs []*message.Message
				for j := range 20 {
					msgs = append(msgs, tenantMsg("a", fmt.Sprintf("a-pay-%d", j), j%10+1, 10), tenantMsg("b", fmt.Sprintf("b-pay-%d", j), j%10+1, 20))
				}
				start := time.Now()
				for k, err := range deliverLimited(h, msgs, 32) {
					if err != nil {
						t.Fatalf("%s: %v", msgs[k].UUID, err)
					}
				}
				took := time.Since(start)
				if took > claimTimeout/2 {
					t.Errorf("a's and b's 40 messages took %v with c down, want well under c's claim timeout %v", took, claimTimeout)
				}
				var cErrs []error
				if fault.name == "hanging" {
					select {
					case cErrs = <-cDone:
						t.Fatal("c's deliveries ended before a's and b's were processed: the test did not overlap them")
					default:
					}
				}
				if cErrs == nil {
					select {
					case cErrs = <-cDone:
					case <-time.After(3 * claimTimeout):
						t.Fatal("c's deliveries did not end")
					}
				}
				for k, err := range cErrs {
					if err == nil || inbox.IsPermanent(err) {
						t.Errorf("%s: %v, want a nack that is not permanent", cMsgs[k].UUID, err)
					}
				}
				for _, tenant := range []string{"a", "b"} {
					d := dbs[tenant]
					if n := d.count(t, "SELECT count(*) FROM "+d.store.Table()); n != 20 {
						t.Errorf("tenant %s: %d inbox rows, want 20", tenant, n)
					}
				}
				if a, b := dbs["a"].balance(t, 1), dbs["b"].balance(t, 1); a != 20 || b != 40 {
					t.Errorf("account 1: a=%d b=%d, want 20 and 40", a, b)
				}
				if st := ib.Stats(); st.Processed != 40 || st.Failed != 8 || st.DeadLettered != 0 {
					t.Errorf("stats %+v: want 40 processed, 8 failed, none dead-lettered", st)
				}
				t.Logf("%s database: a's and b's 40 messages in %v", fault.name, took)
			})
		}
	}
}

// TestStoresConfig checks what New refuses about Store, Stores and Route, and that
// RouteFromMetadata refuses broker-side fields.
func TestStoresConfig(t *testing.T) {
	a, b := storetest.NewMemStore(), storetest.NewMemStore()
	route := routeByTenant(t)
	for name, cfg := range map[string]inbox.Config{
		"neither":              {},
		"both":                 {Store: a, Stores: map[string]inbox.Store{"a": a}, Route: route},
		"empty Stores":         {Stores: map[string]inbox.Store{}, Route: route},
		"Stores without Route": {Stores: map[string]inbox.Store{"a": a}},
		"Route without Stores": {Store: a, Route: route},
		"nil store":            {Stores: map[string]inbox.Store{"a": a, "b": nil}, Route: route},
		"empty route name":     {Stores: map[string]inbox.Store{"": a}, Route: route},
	} {
		cfg.ConsumerName = "billing"
		if _, err := inbox.New(cfg, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("%s: got %v, want ErrInvalidConfig", name, err)
		}
	}
	// Two routes may share a store (two small tenants on one database).
	if _, err := inbox.New(inbox.Config{Stores: map[string]inbox.Store{"a": a, "a2": a, "b": b}, Route: route, ConsumerName: "billing"}, nil); err != nil {
		t.Errorf("two routes on one store: %v", err)
	}
	if _, err := inbox.RouteFromMetadata("x-delivery-count"); !errors.Is(err, inbox.ErrBrokerSideKey) {
		t.Errorf("RouteFromMetadata(x-delivery-count): %v, want ErrBrokerSideKey", err)
	}
	if _, err := inbox.RouteFromMetadata(" "); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("RouteFromMetadata(blank): %v, want ErrInvalidConfig", err)
	}
}

// TestStoresReplayOnEveryStore: Replay by message ID, which names no route, finds the
// dead-lettered key on whichever store holds it.
func TestStoresReplayOnEveryStore(t *testing.T) {
	a, b := storetest.NewMemStore(), storetest.NewMemStore()
	ib, err := inbox.New(inbox.Config{Stores: map[string]inbox.Store{"a": a, "b": b}, Route: routeByTenant(t), ConsumerName: "billing"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	k := inbox.Key{MessageID: "pay-1", ConsumerName: "billing"}
	if err := b.MarkDeadLettered(context.Background(), k, "test"); err != nil {
		t.Fatal(err)
	}
	replayed, err := ib.Replay(context.Background(), "pay-1")
	if err != nil || !replayed {
		t.Fatalf("Replay: %v, %v; want true", replayed, err)
	}
	if again, err := ib.Replay(context.Background(), "pay-1"); err != nil || again {
		t.Fatalf("second Replay: %v, %v; want false", again, err)
	}
}
