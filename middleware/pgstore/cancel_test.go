package pgstore_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// blockTable holds an ACCESS EXCLUSIVE lock on s's inbox table in a transaction of its own, so
// that a claim statement waits on the server, until the returned func rolls it back.
func blockTable(t *testing.T, pool *pgxpool.Pool, s *pgstore.Store) func() {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "LOCK TABLE "+s.Table()+" IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	unblock := func() { once.Do(func() { _ = tx.Rollback(ctx) }) }
	t.Cleanup(unblock)
	return unblock
}

// TestClaimCancelledOnTheServer: a claim whose statement waits on the server (the inbox
// table is locked) and whose context ends is cancelled there (a cancel request): it returns
// the context's error at once, not ErrClaimInFlight (no delivery holds the key), leaves
// nothing behind, counts nothing, and the pool stays usable; counted first or not, single or
// batch.
func TestClaimCancelledOnTheServer(t *testing.T) {
	sch := testenv.NewSchema(t, 3)
	s := sch.Store(t)
	ctx := context.Background()
	d := plain("m-cancel", "c")
	for _, c := range []struct {
		name  string
		claim func(ctx context.Context, d contract.Delivery) error
	}{
		{"single", func(ctx context.Context, d contract.Delivery) error {
			tx, _, err := s.Claim(ctx, d)
			release(tx)
			return err
		}},
		{"batch", func(ctx context.Context, d contract.Delivery) error {
			bt, _, err := s.ClaimBatch(ctx, []contract.Delivery{d})
			if bt != nil {
				_ = bt.Rollback(ctx)
			}
			return err
		}},
	} {
		for _, first := range []bool{false, true} {
			unblock := blockTable(t, sch.Pool, s)
			cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			start := time.Now()
			err := c.claim(cctx, countedFirst(d, first))
			cancel()
			if !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, pgstore.ErrClaimInFlight) {
				t.Fatalf("%s, counted first %v: a claim cancelled while it waited on the server: %v, want the deadline", c.name, first, err)
			}
			if waited := time.Since(start); waited > 5*time.Second {
				t.Fatalf("%s: the cancelled claim took %v", c.name, waited)
			}
			unblock()
			if rows, records := rowsAndRecords(t, sch.Pool, s); rows+records != 0 {
				t.Fatalf("%s: after the cancelled claim: %d rows, %d attempt records; want none", c.name, rows, records)
			}
		}
	}
	mustCommit(t, s, countedFirst(d, true)) // the key is free, the pool usable
	if rows, records := rowsAndRecords(t, sch.Pool, s); rows != 1 || records != 0 {
		t.Fatalf("after the claim: %d rows, %d attempt records; want 1 and 0", rows, records)
	}
}

// TestClaimWhoseCancelRequestCannotBeSent: a claim waits on the server (the inbox table is
// locked), its context ends, and the cancel request cannot reach the server (its dial is
// refused, as behind a pooler that drops cancel requests). The store gives up on the
// connection without touching it from another goroutine (the race detector watches), within
// the finish timeout, and returns an error; nothing is left behind and the pool stays usable.
func TestClaimWhoseCancelRequestCannotBeSent(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	s := sch.Store(t)
	cfg, err := pgxpool.ParseConfig(sch.URL)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	var refuse atomic.Bool
	var d net.Dialer
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if refuse.CompareAndSwap(true, false) { // the cancel request's dial
			return nil, errors.New("dial refused (cancel request)")
		}
		return d.DialContext(ctx, network, addr)
	}
	ctx := context.Background()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := pool.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	s2, err := pgstore.New(pool, pgstore.Config{Schema: sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	p := countedFirst(plain("m-held", "c"), true)
	p.FinishTimeout = 2 * time.Second
	unblock := blockTable(t, sch.Pool, s)
	refuse.Store(true)
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	tx, _, err := s2.Claim(cctx, p)
	if err == nil {
		release(tx)
		t.Fatal("a claim behind a locked table succeeded")
	}
	if waited := time.Since(start); waited > 5*time.Second {
		t.Fatalf("the abandoned claim took %v", waited)
	}
	if refuse.Load() {
		t.Fatal("no cancel request was tried: the claim did not wait on the server")
	}
	unblock()
	if err := pool.Ping(ctx); err != nil {
		t.Fatalf("the pool is not usable after the abandoned claim: %v", err)
	}
	if rows, records := rowsAndRecords(t, sch.Pool, s); rows+records != 0 {
		t.Fatalf("after the abandoned claim: %d rows, %d attempt records; want none", rows, records)
	}
	mustCommit(t, s2, p)
	if rows, records := rowsAndRecords(t, sch.Pool, s); rows != 1 || records != 0 {
		t.Fatalf("after the claim: %d rows, %d attempt records; want 1 and 0", rows, records)
	}
}
