package outbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// lockedBuffer is an io.Writer safe for the concurrent log lines of a test.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// capturePublisher keeps what is published (the dead-letter topic of these tests).
type capturePublisher struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (p *capturePublisher) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	return nil
}
func (p *capturePublisher) Close() error { return nil }
func (p *capturePublisher) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.msgs)
}

// appRole creates a LOGIN role with a name unique to the test, grants it exactly what
// pgstore.GrantSQL and outbox.GrantSQL print (plus SELECT, UPDATE on the test's accounts
// table, the handler's own), checks it cannot create tables, drops it when the test ends, and
// returns it with a pool of conns connections logged in as it.
func appRole(t *testing.T, sch *testenv.Schema, obCfg outbox.Config, conns int32) (string, *pgxpool.Pool) {
	t.Helper()
	role, roleURL := testenv.GrantedRole(t, sch, func(role string) (string, error) {
		grants, err := pgstore.GrantSQL(pgstore.Config{Schema: sch.Name}, role)
		if err != nil {
			return "", err
		}
		obGrants, err := outbox.GrantSQL(obCfg, role)
		return grants + obGrants + "GRANT SELECT, UPDATE ON accounts TO " + pgx.Identifier{role}.Sanitize() + ";\n", err
	})
	return role, testenv.NewPool(t, roleURL, conns)
}

// TestLeastPrivilegedRoleRunsTheWholePath: a role with exactly the documented grants (no
// CREATE anywhere) calls Migrate, CheckSchema and InitializeSchema at start-up (nothing is
// pending, so nothing needs DDL), then runs the whole path: claim, handler write, outbox write
// (the BIGSERIAL's sequence), duplicate, dead letter, the relay, Purge. Then one grant is
// revoked (USAGE on the outbox sequence, the grant the issue found missing): a healthy
// message is nacked, never dead-lettered even with MaxAttempts 1, its attempts stay at zero
// and an ERROR line says it is a configuration fault; once granted again it is processed.
func TestLeastPrivilegedRoleRunsTheWholePath(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	ctx := context.Background()
	admin, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	obCfg := outbox.Config{Schema: sch.Name}
	if err := outbox.InitializeSchema(ctx, sch.Pool, obCfg); err != nil {
		t.Fatal(err)
	}
	sch.CreateAccounts(t, 3)
	role, pool := appRole(t, sch, obCfg, 4)

	// Start-up as the application role: nothing pending, so no DDL is attempted.
	store, err := pgstore.New(pool, pgstore.Config{Schema: sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	if applied, err := store.Migrate(ctx); err != nil || len(applied) != 0 {
		t.Fatalf("Migrate as %s with nothing pending: %v, %v", role, applied, err)
	}
	if err := store.CheckSchema(ctx); err != nil {
		t.Fatalf("CheckSchema as %s: %v", role, err)
	}
	if err := outbox.InitializeSchema(ctx, pool, obCfg); err != nil {
		t.Fatalf("outbox.InitializeSchema as %s with the tables in place: %v", role, err)
	}

	var logs lockedBuffer
	ob, err := outbox.New(obCfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	dl := &capturePublisher{}
	ib, err := inbox.New(inbox.Config{
		Store: store, ConsumerName: "billing", Outbox: ob,
		DeadLetterPublisher: dl, DeadLetterTopic: "billing.dead", MaxAttempts: 1,
	}, watermill.NewStdLoggerWithOut(&logs, true, false))
	if err != nil {
		t.Fatal(err)
	}
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if string(msg.Payload) == "poison" {
			return nil, errPoison
		}
		if err := credit(msg); err != nil {
			return nil, err
		}
		return produced(msg), nil
	})
	deliver := func(m *message.Message) error {
		c := m.Copy()
		c.SetContext(inbox.ContextWithPublishTopic(ctx, "receipts"))
		_, err := h(c)
		return err
	}
	count := func(sql string) int64 {
		t.Helper()
		var n int64
		if err := sch.Pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return n
	}
	balance := func() int64 { return count("SELECT balance FROM accounts WHERE id = 1") }
	outboxRows := func() int64 { return count("SELECT count(*) FROM " + obCfg.MessagesTable()) }

	// Processed, then a duplicate.
	m1 := paymentMsg("m-1", 1, 10)
	for i := range 2 {
		if err := deliver(m1); err != nil {
			t.Fatalf("delivery %d of m-1 as %s: %v", i+1, role, err)
		}
	}
	if b, o := balance(), outboxRows(); b != 10 || o != 2 {
		t.Fatalf("balance %d, outbox rows %d; want 10 and 2 (processed once, the duplicate skipped)", b, o)
	}
	// A poison message is dead-lettered (MaxAttempts 1).
	if err := deliver(message.NewMessage("m-poison", []byte("poison"))); err != nil {
		t.Fatalf("poison message as %s: %v, want dead-lettered and acked", role, err)
	}
	if n := count("SELECT count(*) FROM " + store.AttemptsTable() + " WHERE dead_lettered_at IS NOT NULL"); n != 1 || dl.count() != 1 {
		t.Fatalf("dead-lettered rows %d, dead letters %d; want 1 and 1", n, dl.count())
	}
	// The relay, as the application role.
	relayed := newGoChannel()
	t.Cleanup(func() { _ = relayed.Close() })
	ch, err := relayed.Subscribe(ctx, "receipts")
	if err != nil {
		t.Fatal(err)
	}
	startRelay(t, outbox.RelayConfig{Config: obCfg, Pool: pool, Publisher: relayed, ConsumerGroup: "relay", PollInterval: 50 * time.Millisecond})
	// Both, in either order: the relay's default MaxInFlight publishes a batch's rows
	// concurrently (RelayConfig.MaxInFlight).
	got := collect(t, ch, 2, 20*time.Second)
	if ids := []string{got[0].UUID, got[1].UUID}; !slices.Contains(ids, "m-1/1") || !slices.Contains(ids, "m-1/2") {
		t.Fatalf("relayed %v; want m-1/1 and m-1/2", ids)
	}
	// Purge, as the application role.
	if res, err := store.Purge(ctx, pgstore.PurgeParams{Before: time.Now().Add(time.Hour)}); err != nil || res.Deleted != 1 {
		t.Fatalf("Purge as %s: %+v, %v; want 1 row deleted", role, res, err)
	}

	// A grant missing: the outbox sequence. The message is not at fault.
	seq := obCfg.SequenceName()
	sch.Exec(t, "REVOKE USAGE ON SEQUENCE "+seq+" FROM "+pgx.Identifier{role}.Sanitize())
	m2 := paymentMsg("m-2", 1, 5)
	for i := range 3 {
		if err := deliver(m2); err == nil {
			t.Fatalf("delivery %d of m-2 acked without USAGE on %s", i+1, seq)
		}
	}
	if n := count("SELECT count(*) FROM " + store.AttemptsTable() + " WHERE message_id = 'm-2'"); n != 0 || dl.count() != 1 {
		t.Fatalf("attempt rows of m-2 %d, dead letters %d; want 0 and 1: a missing grant used up the message's attempts", n, dl.count())
	}
	if b := balance(); b != 10 {
		t.Fatalf("balance %d, want 10 (rolled back)", b)
	}
	var alert bool
	for _, line := range strings.Split(logs.String(), "\n") {
		if strings.Contains(line, "level=ERROR") && strings.Contains(line, "Configuration fault") && strings.Contains(line, "42501") {
			alert = true
		}
	}
	if !alert {
		t.Fatalf("no ERROR line names the configuration fault (42501):\n%s", logs.String())
	}
	sch.Exec(t, "GRANT USAGE ON SEQUENCE "+seq+" TO "+pgx.Identifier{role}.Sanitize())
	if err := deliver(m2); err != nil {
		t.Fatalf("m-2 after the grant: %v", err)
	}
	if b, o := balance(), outboxRows(); b != 15 || o != 4 {
		t.Fatalf("balance %d, outbox rows %d; want 15 and 4", b, o)
	}

	// A grant missing on the claim's path: INSERT on the inbox table. The count made before
	// the claim is taken back; an ERROR line names the fault.
	faults := strings.Count(logs.String(), "Configuration fault")
	sch.Exec(t, "REVOKE INSERT ON "+store.Table()+" FROM "+pgx.Identifier{role}.Sanitize())
	m3 := paymentMsg("m-3", 1, 1)
	for i := range 3 {
		if err := deliver(m3); err == nil {
			t.Fatalf("delivery %d of m-3 acked without INSERT on the inbox table", i+1)
		}
	}
	if n := count("SELECT count(*) FROM " + store.AttemptsTable() + " WHERE message_id = 'm-3'"); n != 0 || dl.count() != 1 {
		t.Fatalf("attempt rows of m-3 %d, dead letters %d; want 0 and 1", n, dl.count())
	}
	if f := strings.Count(logs.String(), "Configuration fault"); f < faults+3 {
		t.Fatalf("%d new configuration-fault lines for 3 refused claims:\n%s", f-faults, logs.String())
	}
	sch.Exec(t, "GRANT INSERT ON "+store.Table()+" TO "+pgx.Identifier{role}.Sanitize())
	if err := deliver(m3); err != nil {
		t.Fatalf("m-3 after the grant: %v", err)
	}
	if b := balance(); b != 16 {
		t.Fatalf("balance %d, want 16", b)
	}
}

var errPoison = errors.New("poison: the handler always fails")

// TestSequenceNameIsPostgresChoice: the sequence name GrantSQL prints is the one PostgreSQL
// chose for the BIGSERIAL, for a short topic and for the longest one (where PostgreSQL cuts
// the table name).
func TestSequenceNameIsPostgresChoice(t *testing.T) {
	sch := testenv.NewSchema(t, 1)
	for _, topic := range []string{"", "t", strings.Repeat("x", outbox.MaxTopicBytes)} {
		cfg := outbox.Config{Schema: sch.Name, Topic: topic}
		if err := outbox.InitializeSchema(context.Background(), sch.Pool, cfg); err != nil {
			t.Fatal(err)
		}
		var got string
		if err := sch.Pool.QueryRow(context.Background(), "SELECT pg_get_serial_sequence($1, 'offset')", cfg.MessagesTable()).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if want := cfg.SequenceName(); got != want && got != strings.ReplaceAll(want, `"`, "") {
			t.Fatalf("topic %q: PostgreSQL's sequence %s, GrantSQL names %s", topic, got, want)
		}
	}
}
