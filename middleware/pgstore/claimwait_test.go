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

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestClaimWaitingForAConnectionSaysSo: with every pool connection in use, a claim whose
// context ends fails with ErrWaitingForConnection, and its text says what it waited for.
func TestClaimWaitingForAConnectionSaysSo(t *testing.T) {
	sch := testenv.NewSchema(t, 1)
	s := claimWaitStore(t, sch)
	conn, err := sch.Pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, _, err = s.Claim(ctx, inbox.ClaimParams{Key: inbox.Key{MessageID: "m", ConsumerName: "c"}})
	if !errors.Is(err, pgstore.ErrWaitingForConnection) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("claim with the pool exhausted: %v, want ErrWaitingForConnection and the deadline", err)
	}
	if !strings.Contains(err.Error(), "waiting for a pool connection") || !strings.Contains(err.Error(), "1 of 1 connections in use") {
		t.Fatalf("error text %q does not say it waited for a pool connection", err)
	}
}

// TestClaimBehindAClaimInFlightHoldsNoConnection: a claim of a key claimed by an uncommitted
// transaction gives its connection back while it waits (a pool of 2: while it waits, the
// other connection is free for anyone), then, once the first commits, finds the duplicate;
// and a claim whose context ends first wraps ErrClaimInFlight and the deadline, counting
// nothing.
func TestClaimBehindAClaimInFlightHoldsNoConnection(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	s := claimWaitStore(t, sch)
	ctx := context.Background()
	p := inbox.ClaimParams{Key: inbox.Key{MessageID: "m-held", ConsumerName: "c"}}
	first, res, err := s.Claim(ctx, p)
	if err != nil || !res.Claimed {
		t.Fatalf("first claim: %v %+v", err, res)
	}
	type result struct {
		res inbox.CountedClaimResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		tx, r, err := s.ClaimCounted(ctx, inbox.CountedClaimParams{ClaimParams: p, CountFirst: true})
		if tx != nil {
			_ = tx.Rollback(ctx)
		}
		done <- result{r, err}
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
		if r.err != nil || r.res.Claimed {
			t.Fatalf("claim after the first committed: %v %+v, want a duplicate", r.err, r.res)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiting claim did not return after the first committed")
	}

	p.Key.MessageID = "m-held-2"
	first, _, err = s.Claim(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Rollback(ctx)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, _, err = s.ClaimCounted(cctx, inbox.CountedClaimParams{ClaimParams: p, CountFirst: true})
	if !errors.Is(err, pgstore.ErrClaimInFlight) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("claim behind a claim in flight whose context ended: %v, want ErrClaimInFlight and the deadline", err)
	}
	var rows int
	if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+s.AttemptsTable()).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("attempt rows %d (%v), want 0: a wait is not an attempt", rows, err)
	}
}

// claimWaitStore is a store on sch's (migrated) table with ClaimLockTimeout on.
func claimWaitStore(t *testing.T, sch *testenv.Schema) *pgstore.Store {
	t.Helper()
	sch.Store(t) // migrated
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, ClaimLockTimeout: pgstore.DefaultClaimLockTimeout})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// claimPath is one of the claim statement's forms: a plain claim, a counted claim that counts
// first (the key's session lock taken before), and a counted claim that does not (the key's
// transaction lock taken inside the claim statement).
type claimPath struct {
	name              string
	counted, countFst bool
}

var claimPaths = []claimPath{{"plain", false, false}, {"counted-first", true, true}, {"counted-locked", true, false}}

func (c claimPath) claim(ctx context.Context, s *pgstore.Store, p inbox.ClaimParams) (inbox.Tx, bool, error) {
	if !c.counted {
		tx, res, err := s.Claim(ctx, p)
		return tx, res.Claimed, err
	}
	tx, res, err := s.ClaimCounted(ctx, inbox.CountedClaimParams{ClaimParams: p, CountFirst: c.countFst})
	if tx == nil {
		return nil, res.Claimed, err
	}
	return tx, res.Claimed, err
}

// TestClaimLockTimeoutOnEveryLayoutAndPath: with the default configuration (ClaimLockTimeout
// zero: the key's lock tried) and with a positive ClaimLockTimeout, on every layout and every
// claim path, a claim of a key held by an uncommitted claim (of the same path) gives up at
// once (the tried lock) or fails its lock wait with SQLSTATE 55P03 inside the claim statement
// (a positive timeout, and a count-first delivery's session lock in either mode), and waits
// in process (ErrClaimInFlight once its context ends), counting nothing; once the first
// commits, it finds the duplicate; and the handler of a claim that got its key runs under
// the transaction's own lock_timeout, not the claim's.
func TestClaimLockTimeoutOnEveryLayoutAndPath(t *testing.T) {
	at := time.Now().UTC()
	for _, mode := range []struct {
		name    string
		timeout time.Duration
	}{{"tried-lock", 0}, {"lock-timeout", pgstore.DefaultClaimLockTimeout}} {
		for _, l := range everyLayout {
			for _, path := range claimPaths {
				t.Run(mode.name+"/"+l.name+"/"+path.name, func(t *testing.T) {
					cfg := l.cfg
					cfg.ClaimLockTimeout = mode.timeout
					testClaimBehindAClaimInFlight(t, cfg, path, uuid7(mode.name+l.name+path.name, at), at, mode.timeout > 0 || path.countFst)
				})
			}
		}
	}
}

// testClaimBehindAClaimInFlight is one case of TestClaimLockTimeoutOnEveryLayoutAndPath:
// lockWait says the second claim's try ends in a lock wait past lock_timeout (55P03).
func testClaimBehindAClaimInFlight(t *testing.T, cfg pgstore.Config, path claimPath, id string, at time.Time, lockWait bool) {
	s, sch := layoutStore(t, 3, cfg)
	ctx := context.Background()
	p := inbox.ClaimParams{Key: inbox.Key{MessageID: id, ConsumerName: "c"}, PayloadHash: make([]byte, 32), ProducerTime: at}
	first, claimed, err := path.claim(ctx, s, p)
	if err != nil || !claimed {
		t.Fatalf("first claim: %v, claimed %v", err, claimed)
	}
	defer first.Rollback(ctx) // after the Commit below, a no-op
	ptx, _ := pgstore.PgxTx(first)
	var lt string
	if err := ptx.QueryRow(ctx, "SELECT current_setting('lock_timeout')").Scan(&lt); err != nil || lt != "0" {
		t.Fatalf("the handler's lock_timeout is %q (%v), want the server's 0", lt, err)
	}
	// Long enough for several tries on a busy machine.
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	start := time.Now()
	_, _, err = path.claim(cctx, s, p)
	cancel()
	var pgErr *pgconn.PgError
	switch {
	case lockWait && (!errors.Is(err, pgstore.ErrClaimInFlight) || !errors.As(err, &pgErr) || pgErr.Code != pgstore.SQLStateLockNotAvailable):
		t.Fatalf("claim behind a claim in flight: %v, want ErrClaimInFlight wrapping SQLSTATE 55P03", err)
	case !lockWait && (!errors.Is(err, pgstore.ErrClaimInFlight) || errors.As(err, &pgErr)):
		t.Fatalf("claim behind a claim in flight: %v, want ErrClaimInFlight and no lock wait (no SQLSTATE)", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("the claim in flight returned after %s", d)
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

// TestTriedClaimNeverHoldsItsConnectionBehindAKeyInFlight: whatever the configuration of the
// store whose claim holds a key (the default tried lock, a positive ClaimLockTimeout, a
// negative one: every form takes the key's lock), a default store's claim of that key, plain
// or counting first, with LockTimeout set or not, gives its pool connection back while it
// waits (the pool's second connection is free most of the time) and ends with
// ErrClaimInFlight, counting nothing: a count-first delivery's session lock waits at most
// DefaultClaimLockTimeout even when LockTimeout is longer, and LockTimeout bounds the
// in-process wait.
func TestTriedClaimNeverHoldsItsConnectionBehindAKeyInFlight(t *testing.T) {
	for _, holder := range []struct {
		name    string
		timeout time.Duration
	}{{"holder-tried", 0}, {"holder-lock-timeout", pgstore.DefaultClaimLockTimeout}, {"holder-off", -1}} {
		for _, lockTimeout := range []time.Duration{0, 2 * time.Second} {
			for _, countFirst := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/LockTimeout=%s/countFirst=%v", holder.name, lockTimeout, countFirst), func(t *testing.T) {
					hs, sch := layoutStore(t, 2, pgstore.Config{ClaimLockTimeout: holder.timeout})
					s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, LockTimeout: lockTimeout})
					if err != nil {
						t.Fatal(err)
					}
					ctx := context.Background()
					p := inbox.ClaimParams{Key: inbox.Key{MessageID: "m-held", ConsumerName: "c"}}
					first, res, err := hs.Claim(ctx, p)
					if err != nil || !res.Claimed {
						t.Fatalf("first claim: %v %+v", err, res)
					}
					defer first.Rollback(ctx)
					done := make(chan error, 1)
					go func() {
						cctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
						defer cancel()
						tx, _, err := s.ClaimCounted(cctx, inbox.CountedClaimParams{ClaimParams: p, CountFirst: countFirst})
						if tx != nil {
							_ = tx.Rollback(ctx)
						}
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
					var records int
					if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+s.AttemptsTable()).Scan(&records); err != nil || records != 0 {
						t.Errorf("%d attempt records (%v), want 0: a wait is not an attempt", records, err)
					}
				})
			}
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
