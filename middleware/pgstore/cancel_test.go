package pgstore_test

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestClaimWhoseCancelRequestCannotBeSent: a counted claim waits behind another claim, its
// context ends, and the cancel request cannot reach the server (its dial is refused, as
// behind a pooler that drops cancel requests). The store gives up on the connection without
// touching it from another goroutine (the race detector watches), within the finish
// timeout, and returns an error; the pool stays usable. (Whether the count taken before the
// wait committed cannot be known then: docs/design.md lists this window.)
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
	p := inbox.ClaimParams{Key: inbox.Key{MessageID: "m-held", ConsumerName: "c"}, FinishTimeout: 2 * time.Second}
	first, res, err := s.Claim(ctx, p)
	if err != nil || !res.Claimed {
		t.Fatalf("first claim: %v %+v", err, res)
	}
	defer first.Rollback(ctx)
	refuse.Store(true)
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	tx, _, err := s2.ClaimCounted(cctx, inbox.CountedClaimParams{ClaimParams: p, CountFirst: true})
	if err == nil {
		_ = tx.Rollback(ctx)
		t.Fatal("a claim behind an uncommitted claim succeeded")
	}
	if waited := time.Since(start); waited > 5*time.Second {
		t.Fatalf("the abandoned claim took %v", waited)
	}
	if err := pool.Ping(ctx); err != nil {
		t.Fatalf("the pool is not usable after the abandoned claim: %v", err)
	}
}
