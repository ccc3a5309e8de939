package pgstore_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

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
	// While the second claim waits, the pool's other connection is mostly free: acquire it
	// repeatedly with a short deadline.
	free := 0
	for range 20 {
		actx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		c, err := sch.Pool.Acquire(actx)
		cancel()
		if err == nil {
			free++
			c.Release()
		}
		time.Sleep(10 * time.Millisecond)
	}
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
