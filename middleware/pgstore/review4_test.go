package pgstore_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// sessionLockTimeout is the lock_timeout every connection of the review pool starts with, as a
// role's or database's default (ALTER ROLE ... SET lock_timeout) or a pooler's would set it.
const sessionLockTimeout = "7s"

// poolWithLockTimeout is a one-connection pool on sch whose session lock_timeout is
// sessionLockTimeout: every claim and every check after it runs on the same connection.
func poolWithLockTimeout(t *testing.T, sch *testenv.Schema) *pgxpool.Pool {
	t.Helper()
	u, err := url.Parse(sch.URL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("lock_timeout", sessionLockTimeout)
	u.RawQuery = q.Encode()
	return testenv.NewPool(t, u.String(), 1)
}

// connSettings reads the pool's one connection's lock_timeout and the claim's saved setting
// (NULL when never defined on the session).
func connSettings(t *testing.T, pool *pgxpool.Pool) (lt string, saved *string, pid uint32) {
	t.Helper()
	c, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	if err := c.QueryRow(context.Background(), "SELECT current_setting('lock_timeout'), current_setting('watermill_inbox.lock_timeout', true)").Scan(&lt, &saved); err != nil {
		t.Fatal(err)
	}
	return lt, saved, c.Conn().PgConn().PID()
}

// TestReview4HandlerLockTimeoutEverywhere: with a session lock_timeout of 7s (a role's
// default), on every layout, claim path and isolation level, with and without
// StatementTimeout, the handler runs under 7s, never the claim's 2 ms; and after a claim, a
// duplicate, a dead-lettered key and a claim that gave up behind a claim in flight, the pooled
// connection's next user finds lock_timeout 7s.
func TestReview4HandlerLockTimeoutEverywhere(t *testing.T) {
	isos := []sql.IsolationLevel{sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable}
	for _, l := range everyLayout {
		t.Run(l.name, func(t *testing.T) {
			migrated, sch := layoutStore(t, 2, l.cfg)
			pool := poolWithLockTimeout(t, sch)
			keys := newLayoutKeys(migrated.Config())
			ctx := context.Background()
			holder := migrated // on sch.Pool: another connection
			for _, stmt := range []time.Duration{0, 5 * time.Second} {
				cfg := migrated.Config()
				cfg.StatementTimeout = stmt
				s, err := pgstore.New(pool, cfg)
				if err != nil {
					t.Fatal(err)
				}
				check := func(what string) {
					t.Helper()
					lt, saved, _ := connSettings(t, pool)
					if lt != sessionLockTimeout {
						t.Errorf("%s: the pooled connection's lock_timeout is %q afterwards, want %q", what, lt, sessionLockTimeout)
					}
					if saved != nil && *saved != "" {
						t.Errorf("%s: watermill_inbox.lock_timeout is %q on the pooled connection afterwards", what, *saved)
					}
				}
				for _, path := range claimPaths {
					for _, iso := range isos {
						name := fmt.Sprintf("%s-%s-%d-%s", l.name, path.name, iso, stmt)
						p := keys.claim(name).ClaimParams
						p.PayloadHash = make([]byte, 32)
						p.Isolation = iso
						tx, claimed, err := path.claim(ctx, s, p)
						if err != nil || !claimed {
							t.Fatalf("%s: claim: %v %v", name, err, claimed)
						}
						ptx, _ := pgstore.PgxTx(tx)
						var lt string
						if err := ptx.QueryRow(ctx, "SELECT current_setting('lock_timeout')").Scan(&lt); err != nil {
							t.Fatal(err)
						}
						if lt != sessionLockTimeout {
							t.Errorf("%s: the handler runs under lock_timeout %q, want the session's %q", name, lt, sessionLockTimeout)
						}
						if err := tx.Commit(ctx); err != nil {
							t.Fatal(err)
						}
						check(name + " after commit")
						if tx, claimed, err := path.claim(ctx, s, p); err != nil || claimed || tx != nil {
							t.Fatalf("%s: duplicate: %v %v", name, err, claimed)
						}
						check(name + " after a duplicate")
						// Behind a claim in flight until the context ends.
						q := keys.claim(name + "-held").ClaimParams
						q.PayloadHash = make([]byte, 32)
						q.Isolation = iso
						held, _, err := holder.Claim(ctx, q)
						if err != nil {
							t.Fatal(err)
						}
						cctx, cancel := context.WithTimeout(ctx, 60*time.Millisecond)
						_, _, err = path.claim(cctx, s, q)
						cancel()
						_ = held.Rollback(ctx)
						if !errors.Is(err, pgstore.ErrClaimInFlight) {
							t.Errorf("%s: claim behind a claim in flight: %v, want ErrClaimInFlight", name, err)
						}
						check(name + " after ErrClaimInFlight")
					}
				}
				// A dead-lettered key.
				dl := keys.claim(fmt.Sprintf("dead-%s", stmt)).ClaimParams
				dl.PayloadHash = make([]byte, 32)
				if err := s.MarkDeadLettered(ctx, inbox.AttemptParams{Key: dl.Key, Error: "x"}); err != nil {
					t.Fatal(err)
				}
				for _, cf := range []bool{true, false} {
					tx, res, err := s.ClaimCounted(ctx, inbox.CountedClaimParams{ClaimParams: dl, CountFirst: cf})
					if err != nil || tx != nil || !res.Record.DeadLettered {
						t.Fatalf("dead-lettered claim: %v %+v", err, res)
					}
					check("after a dead-lettered key")
				}
				// Batches, counted or not, counting first or not.
				for _, counted := range []bool{false, true} {
					for _, cf := range []bool{false, true} {
						for _, iso := range isos {
							var ps []inbox.CountedClaimParams
							for m := range 3 {
								c := keys.claim(fmt.Sprintf("batch-%v-%v-%d-%d-%s", counted, cf, iso, m, stmt))
								c.PayloadHash = make([]byte, 32)
								c.Isolation = iso
								c.CountFirst = cf && m != 1
								ps = append(ps, c)
							}
							bt, res, err := s.ClaimBatch(ctx, inbox.BatchClaimParams{Claims: ps, Counted: counted, Isolation: iso})
							if err != nil {
								t.Fatal(err)
							}
							for k, r := range res {
								if !r.Claimed {
									t.Fatalf("batch member %d not claimed", k)
								}
							}
							ptx, _ := pgstore.PgxTx(bt)
							var lt string
							if err := ptx.QueryRow(ctx, "SELECT current_setting('lock_timeout')").Scan(&lt); err != nil {
								t.Fatal(err)
							}
							if lt != sessionLockTimeout {
								t.Errorf("batch counted=%v countFirst=%v iso=%d: handlers run under lock_timeout %q, want %q", counted, cf, iso, lt, sessionLockTimeout)
							}
							if err := bt.Commit(ctx); err != nil {
								t.Fatal(err)
							}
							check("after a batch")
							bt, res, err = s.ClaimBatch(ctx, inbox.BatchClaimParams{Claims: ps, Counted: counted, Isolation: iso})
							if err != nil {
								t.Fatal(err)
							}
							for k, r := range res {
								if r.Claimed {
									t.Fatalf("batch member %d claimed twice", k)
								}
							}
							_ = bt.Rollback(ctx)
							check("after a batch of duplicates")
						}
					}
				}
			}
			var rows int
			if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+migrated.AttemptsTable()+" WHERE dead_lettered_at IS NULL").Scan(&rows); err != nil || rows != 0 {
				t.Fatalf("%d live attempt records left (%v), want 0", rows, err)
			}
		})
	}
}

// TestClaimBehindAClaimInFlightAlwaysSaysSo: a claim (single or batch) whose key stays held by
// a delivery in flight until its context ends fails with ErrClaimInFlight every time, however
// the end of its context falls against its pauses: never with ErrWaitingForConnection ("0 of
// N connections in use") or a bare deadline when its last pause ended just as the context did.
// Each try's context ends at a different moment of the pause schedule.
func TestClaimBehindAClaimInFlightAlwaysSaysSo(t *testing.T) {
	for _, l := range []struct {
		name string
		cfg  pgstore.Config
	}{everyLayout[0], everyLayout[1]} {
		t.Run(l.name, func(t *testing.T) {
			s, sch := layoutStore(t, 3, l.cfg)
			keys := newLayoutKeys(s.Config())
			ctx := context.Background()
			p := keys.claim("held").ClaimParams
			p.PayloadHash = make([]byte, 32)
			held, _, err := s.Claim(ctx, p)
			if err != nil {
				t.Fatal(err)
			}
			defer held.Rollback(ctx)
			// Warm the pool up: a first try may wait for a new connection, which is no lock wait.
			// Warm both free connections up (connected, statements prepared): a first try
			// may wait for a new connection or a slow prepare on a busy machine, which is no
			// lock wait.
			for round := range 3 {
				var wg sync.WaitGroup
				for c := range 2 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						w := keys.claim(fmt.Sprintf("warm-%d-%d", round, c)).ClaimParams
						w.PayloadHash = make([]byte, 32)
						if tx, _, err := s.ClaimCounted(ctx, inbox.CountedClaimParams{ClaimParams: w, CountFirst: true}); err == nil && tx != nil {
							_ = tx.Rollback(ctx)
						}
						if bt, _, err := s.ClaimBatch(ctx, inbox.BatchClaimParams{Claims: []inbox.CountedClaimParams{{ClaimParams: w}}, Counted: true}); err == nil {
							_ = bt.Rollback(ctx)
						}
					}()
				}
				wg.Wait()
			}
			wrong := 0
			for i := range 40 {
				d := time.Duration(30+2*i) * time.Millisecond
				cctx, cancel := context.WithTimeout(ctx, d)
				var err error
				if i%2 == 0 {
					_, _, err = s.ClaimCounted(cctx, inbox.CountedClaimParams{ClaimParams: p, CountFirst: true})
				} else {
					_, _, err = s.ClaimBatch(cctx, inbox.BatchClaimParams{Claims: []inbox.CountedClaimParams{{ClaimParams: p}}, Counted: true})
				}
				cancel()
				if !errors.Is(err, pgstore.ErrClaimInFlight) || !errors.Is(err, context.DeadlineExceeded) {
					wrong++
					t.Errorf("try %d (context %s): %v; want ErrClaimInFlight and the deadline", i, d, err)
				}
			}
			var records int
			if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+s.AttemptsTable()+" WHERE message_id = $1", p.Key.MessageID).Scan(&records); err != nil || records != 0 {
				t.Fatalf("%d attempt records (%v), want 0: waits are not attempts", records, err)
			}
			t.Logf("%d of 40 tries misreported", wrong)
		})
	}
}
