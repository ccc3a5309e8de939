package pgstore_test

import (
	"context"
	"encoding/binary"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// wireCounter counts, on every connection of a pool, the frontend messages that make the
// server execute a statement (Execute, and simple Query) and those that end a round trip
// (Sync, and simple Query), from the bytes the client writes. It counts only while on is
// set, after the connections are established, so every Write starts at a message boundary.
type wireCounter struct {
	on                atomic.Bool
	mu                sync.Mutex
	statements, syncs int
}

type countingConn struct {
	net.Conn
	c    *wireCounter
	skip int // bytes of a message begun in an earlier Write
}

func (cc *countingConn) Write(p []byte) (int, error) {
	if cc.c.on.Load() {
		cc.count(p)
	}
	return cc.Conn.Write(p)
}

// count walks the messages in p: a type byte, then a big-endian int32 length that includes
// itself.
func (cc *countingConn) count(p []byte) {
	cc.c.mu.Lock()
	defer cc.c.mu.Unlock()
	for len(p) > 0 {
		if cc.skip > 0 {
			n := min(cc.skip, len(p))
			p, cc.skip = p[n:], cc.skip-n
			continue
		}
		if len(p) < 5 {
			return // a split header: not seen with pgx, which writes whole messages
		}
		switch p[0] {
		case 'E':
			cc.c.statements++
		case 'S':
			cc.c.syncs++
		case 'Q':
			cc.c.statements++
			cc.c.syncs++
		}
		cc.skip = 1 + int(binary.BigEndian.Uint32(p[1:5]))
	}
}

// countingPool returns a pool on sch's schema whose connections count their statements.
func countingPool(t *testing.T, sch *testenv.Schema, conns int32) (*pgxpool.Pool, *wireCounter) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(sch.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns, cfg.MinConns = conns, conns
	// No ping before an acquire (pgxpool pings a connection idle for over a second): on a
	// loaded machine it would be counted as a statement of the delivery.
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	wc := &wireCounter{}
	dialer := &net.Dialer{}
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &countingConn{Conn: c, c: wc}, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, wc
}

// TestStatementsPerDelivery counts, on the wire, the statements and round trips one healthy
// delivery costs (BEGIN, the claim, the handler's one UPDATE, COMMIT), against a bare
// transaction doing the same UPDATE, for the plain inbox and the inbox with a dead-letter topic
// with and without a first-delivery signal; and checks that every delivery applied its UPDATE
// once (the balances). It is the deterministic measure of what the inbox adds to a delivery: a
// change that adds a statement or a round trip to the healthy path fails it.
func TestStatementsPerDelivery(t *testing.T) {
	const n = 40
	sch := testenv.NewSchema(t, 1)
	sch.CreateAccounts(t, 1)
	pool, wc := countingPool(t, sch, 2)
	store, err := pgstore.New(pool, pgstore.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	update := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + 1 WHERE id = 1")
		return err
	}
	dlq := &nopPublisher{}
	first := func(*message.Message) inbox.Redelivery { return inbox.FirstDelivery }
	type cost struct{ statements, roundTrips float64 }
	measure := func(deliver func(*message.Message) error) cost {
		t.Helper()
		for range 2 { // warm up: statements prepared on both connections
			if err := deliver(message.NewMessage(uuid.NewString(), []byte(`{}`))); err != nil {
				t.Fatal(err)
			}
		}
		wc.mu.Lock()
		wc.statements, wc.syncs = 0, 0
		wc.mu.Unlock()
		wc.on.Store(true)
		for range n {
			if err := deliver(message.NewMessage(uuid.NewString(), []byte(`{}`))); err != nil {
				t.Fatal(err)
			}
		}
		wc.on.Store(false)
		wc.mu.Lock()
		defer wc.mu.Unlock()
		return cost{float64(wc.statements) / n, float64(wc.syncs) / n}
	}
	viaInbox := func(cfg inbox.Config) func(*message.Message) error {
		cfg.Store = store
		ib, err := inbox.New(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		h := ib.Middleware(func(m *message.Message) ([]*message.Message, error) {
			tx, _ := pgstore.TxFromContext(m.Context())
			return nil, update(m.Context(), tx)
		})
		return func(m *message.Message) error { _, err := h(m); return err }
	}
	bare := measure(func(m *message.Message) error {
		ctx := context.Background()
		tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
		if err != nil {
			return err
		}
		if err := update(ctx, tx); err != nil {
			_ = tx.Rollback(ctx)
			return err
		}
		return tx.Commit(ctx)
	})
	plain := measure(viaInbox(inbox.Config{ConsumerName: "plain"}))
	signal := measure(viaInbox(inbox.Config{ConsumerName: "signal", DeadLetterPublisher: dlq, DeadLetterTopic: "dead", Redelivery: first}))
	nosignal := measure(viaInbox(inbox.Config{ConsumerName: "nosignal", DeadLetterPublisher: dlq, DeadLetterTopic: "dead"}))
	t.Logf("per delivery: bare %+v; inbox %+v; dead letters with a first-delivery signal %+v; without %+v", bare, plain, signal, nosignal)

	// The plain inbox adds the claim, in BEGIN's round trip (the key's advisory lock is tried
	// inside the claim statement). With a dead-letter topic and a first-delivery signal, a
	// first delivery adds the read of the key's attempt record to that round trip too, and the
	// release of the key's session lock to COMMIT's (its failure would be counted when
	// recorded, under that lock).
	for _, c := range []struct {
		name       string
		got        cost
		statements float64
	}{
		{"inbox", plain, bare.statements + 1},
		{"dead letters, first-delivery signal", signal, bare.statements + 3},
	} {
		if c.got.statements != c.statements || c.got.roundTrips != bare.roundTrips {
			t.Errorf("%s: %+v per delivery, want %v statements and %v round trips", c.name, c.got, c.statements, bare.roundTrips)
		}
	}
	// Without a signal every delivery counts first, in the same round trips: the count's own
	// transaction ahead of the claim's in BEGIN's round trip (BEGIN, SET LOCAL
	// synchronous_commit, queries/count_first.sql, COMMIT), then the claim's BEGIN, the claim
	// and the clean-up of the attempt record; and the release of the key's session lock in
	// COMMIT's round trip.
	if nosignal.roundTrips != bare.roundTrips || nosignal.statements != bare.statements+7 {
		t.Errorf("dead letters, no signal: %+v per delivery, want %v round trips and %v statements", nosignal, bare.roundTrips, bare.statements+7)
	}

	// No advisory lock outlives its delivery (the key's lock is the transaction's).
	for _, c := range pool.AcquireAllIdle(context.Background()) {
		var held int
		err := c.QueryRow(context.Background(), "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()").Scan(&held)
		c.Release()
		if err != nil || held != 0 {
			t.Fatalf("a pooled connection holds %d advisory locks after the deliveries (%v), want 0", held, err)
		}
	}

	var balance int64
	if err := sch.Pool.QueryRow(context.Background(), "SELECT balance FROM accounts WHERE id = 1").Scan(&balance); err != nil {
		t.Fatal(err)
	}
	if want := int64(4 * (n + 2)); balance != want {
		t.Fatalf("balance %d, want %d (one UPDATE per delivery)", balance, want)
	}
	var rows int
	if err := sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+store.AttemptsTable()).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != 0 {
		t.Fatalf("%d attempt rows left after healthy deliveries, want 0", rows)
	}
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }
