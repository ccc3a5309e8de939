package tests

// A consumer over a database per tenant (inbox.Config.Stores), SIGKILLed while deliveries for
// several tenants are in flight: three databases on the local PostgreSQL, one RabbitMQ queue
// carrying every tenant's payments, three competing subscriptions per consumer process.

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// tenantKey is the metadata field the publisher sets and inbox.RouteFromMetadata reads.
const tenantKey = "tenant"

// crashTenants are the route names; tenant i (from 1) pays i, 10*i, 100*i, ... into account 1
// of its own database, so a balance shows which payments ran on it and whose they were.
var crashTenants = []string{"a", "b", "c"}

// Environment of the multi-tenant child consumer (TestHelperTenantsConsumer), beside
// envChildAMQP, envChildQueue, envCrashAfterCommit and envCrashBeforeCommit.
const (
	envTenantsChild = "INBOX_IT_TENANTS_CHILD"
	// envTenantsDLQ is the dead-letter queue: with it the inbox counts attempts durably, in
	// the attempts table of each tenant's database.
	envTenantsDLQ = "INBOX_IT_TENANTS_DLQ"
	// envTenantDSNPrefix + a tenant name holds that tenant's database URL.
	envTenantDSNPrefix = "INBOX_IT_TENANT_DSN_"
)

// tenantsFixture is the world of the multi-tenant crash test.
type tenantsFixture struct {
	dbs    map[string]*testenv.Database
	stores map[string]*pgstore.Store
	rabbit *rabbitAdmin
	queue  string
	dlq    string
	msgs   []*message.Message
	amount map[string]int64  // message ID -> amount
	tenant map[string]string // message ID -> tenant
}

func newTenantsFixture(t *testing.T, perTenant int) *tenantsFixture {
	t.Helper()
	f := &tenantsFixture{
		dbs: map[string]*testenv.Database{}, stores: map[string]*pgstore.Store{},
		rabbit: newRabbitAdmin(t), amount: map[string]int64{}, tenant: map[string]string{},
	}
	for _, name := range crashTenants {
		db := testenv.NewDatabase(t, 4)
		f.dbs[name], f.stores[name] = db, setupBank(t, db.Schema, 1)
	}
	f.queue, f.dlq = f.rabbit.newQueue(t), f.rabbit.newQueue(t)
	// Interleaved a, b, c, a, ...: every stretch of the queue holds all three tenants.
	amount := int64(1)
	for range perTenant {
		for i, name := range crashTenants {
			a := int64(i+1) * amount
			m := paymentMsg(t, watermill.NewUUID(), 1, a)
			m.Metadata.Set(tenantKey, name)
			f.msgs = append(f.msgs, m)
			f.amount[m.UUID], f.tenant[m.UUID] = a, name
		}
		amount *= 10
	}
	f.rabbit.publish(t, f.queue, f.msgs...)
	return f
}

// wantBalance is the balance of tenant i's account 1 once each of its payments ran once:
// 11...1 times i.
func (f *tenantsFixture) wantBalance(name string) (s int64) {
	for id, a := range f.amount {
		if f.tenant[id] == name {
			s += a
		}
	}
	return s
}

func (f *tenantsFixture) pool(name string) *pgxpool.Pool { return f.dbs[name].Pool }

// inboxIDs returns the message IDs of the inbox rows in tenant name's database.
func (f *tenantsFixture) inboxIDs(t *testing.T, name string) []string {
	t.Helper()
	rows, err := f.pool(name).Query(t.Context(), "SELECT message_id FROM "+f.stores[name].Table()+" WHERE consumer_name = $1 ORDER BY message_id", bankConsumerName)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return ids
}

func (f *tenantsFixture) balance(t *testing.T, name string) int64 {
	return queryInt(t, f.pool(name), "SELECT balance FROM accounts WHERE id = 1")
}

// assertConsistent checks, after a crash, that every tenant's database holds only its own
// tenant's inbox rows and that its balance is exactly the sum of the payments whose inbox row
// committed: the payment and its claim committed together or not at all.
func (f *tenantsFixture) assertConsistent(t *testing.T, when string) {
	t.Helper()
	for _, name := range crashTenants {
		var sum int64
		for _, id := range f.inboxIDs(t, name) {
			if f.tenant[id] != name {
				t.Errorf("%s: database of tenant %s holds the inbox row of %s, a message of tenant %q", when, name, id, f.tenant[id])
			}
			sum += f.amount[id]
		}
		if got := f.balance(t, name); got != sum {
			t.Errorf("%s: tenant %s balance = %d, want %d (the payments whose inbox row committed)", when, name, got, sum)
		}
	}
}

// hasRow reports whether message id has an inbox row in tenant name's database.
func (f *tenantsFixture) hasRow(t *testing.T, name, id string) bool {
	return slices.Contains(f.inboxIDs(t, name), id)
}

func (f *tenantsFixture) runs(t *testing.T, name, id string, pid int) int64 {
	return queryInt(t, f.pool(name), "SELECT count(*) FROM handler_runs WHERE message_id = $1 AND pid = $2", id, pid)
}

// startTenantsChild starts a multi-tenant child consumer with extra environment entries and
// waits for its READY line.
func (f *tenantsFixture) startTenantsChild(t *testing.T, extraEnv ...string) *childProc {
	t.Helper()
	env := []string{
		envTenantsChild + "=1",
		envChildAMQP + "=" + f.rabbit.url,
		envChildQueue + "=" + f.queue,
		envTenantsDLQ + "=" + f.dlq,
	}
	for _, name := range crashTenants {
		env = append(env, envTenantDSNPrefix+name+"="+f.dbs[name].URL)
	}
	c := &childProc{testenv.StartChild(t, "TestHelperTenantsConsumer", append(env, extraEnv...))}
	c.WaitLine(t, "READY ", 30*time.Second)
	return c
}

// crashChild starts a child that SIGKILLs itself at the crash point crashEnv names for
// message id, and checks that it died of SIGKILL there and that RabbitMQ dropped its
// consumers (requeueing their unacked deliveries).
func (f *tenantsFixture) crashChild(t *testing.T, crashEnv, where, id string) *childProc {
	t.Helper()
	c := f.startTenantsChild(t, crashEnv+"="+id)
	if err := c.WaitExit(t, 20*time.Second); !testenv.KilledBySIGKILL(err) {
		t.Fatalf("child should have died of SIGKILL %s, got %v", where, err)
	}
	want := fmt.Sprintf("CRASH %s %s", where, id)
	if line, ok := c.Find("CRASH "); !ok || line != want {
		t.Fatalf("child died without reaching the injected crash point: CRASH line %q, want %q", line, want)
	}
	waitUntil(t, 10*time.Second, "RabbitMQ to drop the killed consumer", func() (bool, string) {
		_, consumers := f.rabbit.queueState(t, f.queue)
		return consumers == 0, fmt.Sprintf("consumers=%d", consumers)
	})
	return c
}

// TestCrashTenantsInFlight runs one consumer over a database per tenant (three databases),
// with three deliveries in flight at a time, and SIGKILLs it twice: after the inbox committed
// a payment of tenant b and before the router acked it, then inside the handler of a payment
// of tenant a, after its UPDATE and before the commit. RabbitMQ's redelivery drives the retry;
// a third process drains the queue. Every payment is applied exactly once, on its own tenant's
// database only; each database holds one inbox row per message of its tenant and no attempts
// row; nothing is left in the queue or dead-lettered.
func TestCrashTenantsInFlight(t *testing.T) {
	start := time.Now()
	const perTenant = 5
	f := newTenantsFixture(t, perTenant)
	afterCommit := f.msgs[4]       // tenant b: crashAt 4 of 15, while 5 and 6 are in flight
	midTx := f.msgs[len(f.msgs)-6] // tenant a, in the second half: the first child never reaches it
	if f.tenant[afterCommit.UUID] != "b" || f.tenant[midTx.UUID] != "a" {
		t.Fatalf("fixture order changed: crash messages of tenants %s and %s", f.tenant[afterCommit.UUID], f.tenant[midTx.UUID])
	}

	// 1. SIGKILL after the commit, before the ack.
	first := f.crashChild(t, envCrashAfterCommit, "after-commit", afterCommit.UUID)
	f.assertConsistent(t, "after the after-commit crash")
	if !f.hasRow(t, "b", afterCommit.UUID) {
		t.Fatalf("the message killed after its commit has no inbox row in tenant b's database")
	}
	if f.hasRow(t, "a", midTx.UUID) {
		t.Fatalf("the first child processed the second crash message: the test's order assumption broke")
	}

	// 2. SIGKILL inside the handler of a payment of tenant a, before its commit.
	second := f.crashChild(t, envCrashBeforeCommit, "before-commit", midTx.UUID)
	f.assertConsistent(t, "after the mid-transaction crash")
	if f.hasRow(t, "a", midTx.UUID) {
		t.Fatalf("the message killed inside its transaction has an inbox row")
	}
	if n := f.runs(t, "a", midTx.UUID, second.Pid()); n != 1 {
		t.Fatalf("handler runs of the mid-transaction crash message in the second child = %d, want 1", n)
	}
	// Its attempt was counted durably on its tenant's database, and there only.
	for _, name := range crashTenants {
		n := queryInt(t, f.pool(name), "SELECT count(*) FROM "+attemptsTable+" WHERE message_id = $1", midTx.UUID)
		if want := map[bool]int64{true: 1, false: 0}[name == "a"]; n != want {
			t.Errorf("attempts rows of the mid-transaction crash message in tenant %s's database = %d, want %d", name, n, want)
		}
	}

	// 3. A clean consumer drains the queue.
	third := f.startTenantsChild(t)
	waitUntil(t, 20*time.Second, "the restarted consumer to drain the queue", func() (bool, string) {
		ready, _ := f.rabbit.queueState(t, f.queue)
		rows := 0
		for _, name := range crashTenants {
			rows += len(f.inboxIDs(t, name))
		}
		return ready == 0 && rows >= len(f.msgs), fmt.Sprintf("ready=%d inbox rows=%d of %d", ready, rows, len(f.msgs))
	})
	time.Sleep(ackGrace)
	st := third.stop(t)

	f.assertConsistent(t, "at the end")
	for i, name := range crashTenants {
		if got, want := f.balance(t, name), f.wantBalance(name); got != want || want != int64(i+1)*11111 {
			t.Errorf("tenant %s balance = %d, want %d (each of its payments exactly once)", name, got, want)
		}
		var want []string
		for _, m := range f.msgs {
			if f.tenant[m.UUID] == name {
				want = append(want, m.UUID)
			}
		}
		slices.Sort(want)
		if got := f.inboxIDs(t, name); !slices.Equal(got, want) {
			t.Errorf("tenant %s inbox rows = %d %v, want its %d messages %v", name, len(got), got, len(want), want)
		}
		if n := queryInt(t, f.pool(name), "SELECT count(*) FROM "+attemptsTable); n != 0 {
			t.Errorf("tenant %s attempts rows = %d, want 0 (a success deletes its message's)", name, n)
		}
	}
	// The message killed after its commit ran its handler once: its redelivery was a duplicate.
	if n := queryInt(t, f.pool("b"), "SELECT count(*) FROM handler_runs WHERE message_id = $1", afterCommit.UUID); n != 1 {
		t.Errorf("handler runs of the after-commit crash message = %d, want 1", n)
	}
	if n := f.runs(t, "b", afterCommit.UUID, first.Pid()); n != 1 {
		t.Errorf("handler runs of the after-commit crash message in the first child = %d, want 1", n)
	}
	// The message killed inside its transaction ran again, in the third process.
	if n := f.runs(t, "a", midTx.UUID, third.Pid()); n != 1 {
		t.Errorf("handler runs of the mid-transaction crash message in the third child = %d, want 1", n)
	}
	if ready, consumers := f.rabbit.queueState(t, f.queue); ready != 0 || consumers != 0 {
		t.Errorf("queue after the consumers stopped: ready=%d consumers=%d, want 0 and 0", ready, consumers)
	}
	if ready, _ := f.rabbit.queueState(t, f.dlq); ready != 0 {
		t.Errorf("dead-letter queue holds %d messages, want 0", ready)
	}
	// The after-commit crash message's redelivery reached the second child, a duplicate there.
	if st.Failed != 0 || st.Processed == 0 {
		t.Errorf("third child stats = %+v, want failed=0 and some processed", st)
	}
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}

// TestHelperTenantsConsumer is not a test: it is the consumer process TestCrashTenantsInFlight
// starts (the test binary re-executed with INBOX_IT_TENANTS_CHILD=1) and kills. Without
// INBOX_IT_TENANTS_CHILD it returns at once. One inbox over a store per tenant
// (INBOX_IT_TENANT_DSN_<tenant>), routed by the "tenant" metadata field, dead-lettering to
// INBOX_IT_TENANTS_DLQ, behind three router handlers on INBOX_IT_QUEUE (three deliveries in
// flight). The handler records its run on its tenant's database (autocommit), applies the
// payment on the inbox transaction and holds it 20 ms. The crash variables are those of
// TestHelperConsumer. On SIGTERM it prints "STATS processed=N duplicates=N failed=N".
func TestHelperTenantsConsumer(t *testing.T) {
	if os.Getenv(envTenantsChild) != "1" {
		return
	}
	logger := watermill.NewStdLoggerWithOut(os.Stderr, false, false)
	pools, stores := map[string]*pgxpool.Pool{}, map[string]inbox.Store{}
	for _, name := range crashTenants {
		pools[name] = testenv.NewPool(t, os.Getenv(envTenantDSNPrefix+name), 8)
		s, err := pgstore.New(pools[name], pgstore.Config{Schema: "public"})
		if err != nil {
			t.Fatalf("pgstore.New: %v", err)
		}
		stores[name] = s
	}
	route, err := inbox.RouteFromMetadata(tenantKey)
	if err != nil {
		t.Fatal(err)
	}
	amqpURL, queue := os.Getenv(envChildAMQP), os.Getenv(envChildQueue)
	dlPub := newAMQPBroker(t, amqpURL, nil, logger).Publisher
	ib, err := inbox.New(inbox.Config{Stores: stores, Route: route, ConsumerName: bankConsumerName,
		DeadLetterPublisher: dlPub, DeadLetterTopic: os.Getenv(envTenantsDLQ)}, logger)
	if err != nil {
		t.Fatalf("inbox.New: %v", err)
	}
	afterCommit, beforeCommit := os.Getenv(envCrashAfterCommit), os.Getenv(envCrashBeforeCommit)
	handler := func(msg *message.Message) error {
		tenant := msg.Metadata.Get(tenantKey)
		pool := pools[tenant]
		if _, err := pool.Exec(msg.Context(), "INSERT INTO handler_runs (message_id, pid) VALUES ($1, $2)", msg.UUID, os.Getpid()); err != nil {
			return fmt.Errorf("record handler run: %w", err)
		}
		err := bankHandler(consumerConfig{})(msg)
		if err == nil && msg.UUID == beforeCommit {
			crashNow("before-commit", msg.UUID)
		}
		time.Sleep(20 * time.Millisecond) // keep the transaction open beside the others
		return err
	}

	sub := newAMQPBroker(t, amqpURL, nil, logger).Subscriber
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, logger)
	if err != nil {
		t.Fatalf("router: %v", err)
	}
	router.AddMiddleware(nackDelay(25 * time.Millisecond))
	if afterCommit != "" {
		router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				if err == nil && msg.UUID == afterCommit {
					crashNow("after-commit", msg.UUID)
				}
				return out, err
			}
		})
	}
	for i := range 3 {
		h := router.AddConsumerHandler(fmt.Sprintf("bank-%d", i), queue, sub, handler)
		h.AddMiddleware(ib.Middleware)
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	running := testenv.RunRouter(t, router)
	fmt.Printf("READY %d\n", os.Getpid())
	testenv.WaitChildStop(t, ctx, "tenants child consumer")
	if err := running.Close(); err != nil {
		t.Errorf("close consumer: %v", err)
	}
	st := ib.Stats()
	fmt.Printf("STATS processed=%d duplicates=%d failed=%d\n", st.Processed, st.Duplicates, st.Failed)
}
