package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestClaimWaitingForAConnectionSaysSo: with every pool connection in use, a claim whose
// context ends fails with ErrWaitingForConnection, and its text says what it waited for;
// nothing is written.
func TestClaimWaitingForAConnectionSaysSo(t *testing.T) {
	sch := testenv.NewSchema(t, 1)
	s := sch.Store(t)
	conn, err := sch.Pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, _, err = s.Claim(ctx, countedFirst(plain("m", "c"), true))
	conn.Release()
	if !errors.Is(err, pgstore.ErrWaitingForConnection) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("claim with the pool exhausted: %v, want ErrWaitingForConnection and the deadline", err)
	}
	if !strings.Contains(err.Error(), "waiting for a pool connection") || !strings.Contains(err.Error(), "1 of 1 connections in use") {
		t.Fatalf("error text %q does not say it waited for a pool connection", err)
	}
	if rows, records := rowsAndRecords(t, sch.Pool, s); rows+records != 0 {
		t.Fatalf("%d rows, %d attempt records; want none", rows, records)
	}
}

// TestClaimBehindAClaimInFlightHoldsNoConnection: a claim of a key claimed by an uncommitted
// transaction gives its connection back while it waits (a pool of 2: while it waits, the
// other connection is free for anyone), then, once the first commits, finds the duplicate;
// and a claim whose context ends first wraps ErrClaimInFlight and the deadline, counting
// nothing.
func TestClaimBehindAClaimInFlightHoldsNoConnection(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	s := sch.Store(t)
	ctx := context.Background()
	p := plain("m-held", "c")
	first, _ := mustClaim(t, s, p, contract.Run)
	type result struct {
		c   contract.Claim
		err error
	}
	done := make(chan result, 1)
	go func() {
		cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		tx, c, err := s.Claim(cctx, countedFirst(p, true))
		release(tx)
		done <- result{c, err}
	}()
	// While the second claim waits, the pool's other connection is mostly free.
	free := freeConnectionProbes(sch.Pool)
	if free < 10 {
		t.Fatalf("the waiting claim held its connection: the pool's second connection was free %d times of 20", free)
	}
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-done:
		if r.err != nil || r.c.Decision != contract.Duplicate {
			t.Fatalf("claim after the first committed: %v %+v, want a duplicate", r.err, r.c)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiting claim did not return after the first committed")
	}

	p.Key.MessageID = "m-held-2"
	first, _ = mustClaim(t, s, p, contract.Run)
	defer release(first)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, _, err := s.Claim(cctx, countedFirst(p, true))
	if !errors.Is(err, pgstore.ErrClaimInFlight) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("claim behind a claim in flight whose context ended: %v, want ErrClaimInFlight and the deadline", err)
	}
	rows, records := rowsAndRecords(t, sch.Pool, s)
	if rows != 1 || records != 0 {
		t.Fatalf("%d inbox rows, %d attempt records; want 1 (m-held) and 0: a wait is not an attempt", rows, records)
	}
}

// claimPath is one of the claim's forms: a plain claim, a counted claim that counts first
// (the count made after the claim, by the group count), and a counted claim that does not
// (the attempt record read only).
type claimPath struct {
	name              string
	counted, countFst bool
}

var claimPaths = []claimPath{{"plain", false, false}, {"counted-first", true, true}, {"counted-record", true, false}}

// delivery is d in the path's form.
func (c claimPath) delivery(d contract.Delivery) contract.Delivery {
	if c.counted {
		return countedFirst(d, c.countFst)
	}
	return d
}

// claim claims d in the path's form; claimed: decided Run.
func (c claimPath) claim(ctx context.Context, s *pgstore.Store, d contract.Delivery) (contract.Tx, bool, error) {
	tx, cl, err := s.Claim(ctx, c.delivery(d))
	return tx, err == nil && cl.Decision == contract.Run, err
}

// TestClaimInFlightOnEveryLayoutAndPath: on every layout and every claim path, a claim of a
// key held by an uncommitted claim (of the same path) never waits on the server (the key's
// advisory lock is tried inside the claim statement: no lock wait, no SQLSTATE) and waits in
// process (ErrClaimInFlight once its context ends), counting nothing; once the first commits,
// it finds the duplicate; and the handler of a claim that got its key runs under the
// server's lock_timeout.
func TestClaimInFlightOnEveryLayoutAndPath(t *testing.T) {
	at := time.Now().UTC()
	for _, l := range everyLayout {
		for _, path := range claimPaths {
			t.Run(l.name+"/"+path.name, func(t *testing.T) {
				testClaimBehindAClaimInFlight(t, l.cfg, path, uuid7(l.name+path.name, at), at)
			})
		}
	}
}

// testClaimBehindAClaimInFlight is one case of TestClaimInFlightOnEveryLayoutAndPath.
func testClaimBehindAClaimInFlight(t *testing.T, cfg pgstore.Config, path claimPath, id string, at time.Time) {
	s, sch := layoutStore(t, 3, cfg)
	ctx := context.Background()
	p := contract.Delivery{Key: contract.Key{MessageID: id, ConsumerName: "c"}, PayloadHash: make([]byte, 32), ProducerTime: at}
	first, claimed, err := path.claim(ctx, s, p)
	if err != nil || !claimed {
		t.Fatalf("first claim: %v, claimed %v", err, claimed)
	}
	defer release(first) // after the Commit below, a no-op
	var lt string
	if err := handlerTx(t, first).QueryRow(ctx, "SELECT current_setting('lock_timeout')").Scan(&lt); err != nil || lt != "0" {
		t.Fatalf("the handler's lock_timeout is %q (%v), want the server's 0", lt, err)
	}
	// Long enough for several tries on a busy machine.
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	start := time.Now()
	_, _, err = path.claim(cctx, s, p)
	cancel()
	var pgErr *pgconn.PgError
	if !errors.Is(err, pgstore.ErrClaimInFlight) || !errors.Is(err, context.DeadlineExceeded) || errors.As(err, &pgErr) {
		t.Fatalf("claim behind a claim in flight: %v, want ErrClaimInFlight and the deadline, and no lock wait (no SQLSTATE)", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("the claim in flight returned after %s", d)
	}
	if path.counted {
		// The holder's own count (first) or none is all there is: the wait counted nothing.
		n, _ := attemptsRow(t, sch.Pool, s, p.Key)
		if n != b2i(path.countFst) {
			t.Fatalf("%d attempts while the first claim is open, want %d", n, b2i(path.countFst))
		}
	}
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	tx, claimed, err := path.claim(ctx, s, p)
	if err != nil || claimed || tx != nil {
		t.Fatalf("claim after the first committed: %v, claimed %v; want a duplicate", err, claimed)
	}
	rows, records := rowsAndRecords(t, sch.Pool, s)
	if rows != 1 || records != 0 {
		t.Fatalf("%d inbox rows and %d attempt records, want 1 and 0: waits are not attempts", rows, records)
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestTriedClaimNeverHoldsItsConnectionBehindAKeyInFlight: a claim of a key held by a
// delivery in flight, plain, counted or counting first, with LockTimeout set or not, gives
// its pool connection back while it waits (the pool's second connection is free most of the
// time) and ends with ErrClaimInFlight, counting nothing; LockTimeout bounds the in-process
// wait.
func TestTriedClaimNeverHoldsItsConnectionBehindAKeyInFlight(t *testing.T) {
	for _, lockTimeout := range []time.Duration{0, 2 * time.Second} {
		for _, path := range claimPaths {
			t.Run(fmt.Sprintf("LockTimeout=%s/%s", lockTimeout, path.name), func(t *testing.T) {
				hs, sch := layoutStore(t, 2, pgstore.Config{})
				s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, LockTimeout: lockTimeout})
				if err != nil {
					t.Fatal(err)
				}
				ctx := context.Background()
				p := plain("m-held", "c")
				first, _ := mustClaim(t, hs, p, contract.Run)
				defer release(first)
				done := make(chan error, 1)
				go func() {
					cctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
					defer cancel()
					tx, _, err := path.claim(cctx, s, p)
					release(tx)
					done <- err
				}()
				free := freeConnectionProbes(sch.Pool)
				err = <-done
				if free < 10 {
					t.Errorf("the waiting claim held its connection: the pool's second connection was free %d times of 20", free)
				}
				if !errors.Is(err, pgstore.ErrClaimInFlight) {
					t.Errorf("claim behind a key in flight: %v, want ErrClaimInFlight", err)
				}
				if rows, records := rowsAndRecords(t, sch.Pool, s); rows != 0 || records != 0 {
					t.Errorf("%d inbox rows, %d attempt records; want 0 and 0: a wait is not an attempt", rows, records)
				}
			})
		}
	}
}

// rowsAndRecords counts the rows of s's inbox table and of its attempts table.
func rowsAndRecords(t testing.TB, pool *pgxpool.Pool, s *pgstore.Store) (rows, records int) {
	t.Helper()
	if err := pool.QueryRow(context.Background(), "SELECT (SELECT count(*) FROM "+s.Table()+"), (SELECT count(*) FROM "+s.AttemptsTable()+")").Scan(&rows, &records); err != nil {
		t.Fatal(err)
	}
	return rows, records
}

// freeConnectionProbes acquires a connection of pool 20 times, each with a 50 ms deadline and
// released at once, 10 ms apart, and returns how many succeeded: while a claim waits without
// its connection (the in-process wait), the pool's other connection is free most of the time.
func freeConnectionProbes(pool *pgxpool.Pool) int {
	free := 0
	for range 20 {
		actx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		if c, err := pool.Acquire(actx); err == nil {
			free++
			c.Release()
		}
		cancel()
		time.Sleep(10 * time.Millisecond)
	}
	return free
}
