package pgstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestBatchSnapshotSeesTheLastHoldersRecord: under REPEATABLE READ and SERIALIZABLE a batch's
// snapshot is taken at its first claim. A member whose key another delivery held until just
// after that snapshot (it recorded its failure and released the key while the batch's first
// claim waited) must not run with the attempts the old snapshot shows: the batch takes its
// keys' locks ahead of its snapshot, and such a member is decided RunAlone. The wait is made
// real: a trigger stops the insert of the batch's first claim, after its snapshot, on an advisory
// lock the test holds until the holder of the second key has failed.
func TestBatchSnapshotSeesTheLastHoldersRecord(t *testing.T) {
	for _, l := range everyLayout {
		for _, iso := range []sql.IsolationLevel{sql.LevelRepeatableRead, sql.LevelSerializable} {
			for _, countFirst := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/%s/countFirst=%v", l.name, iso, countFirst), func(t *testing.T) {
					s, sch := layoutStore(t, 6, l.cfg)
					keys := newLayoutKeys(s.Config())
					ctx := context.Background()
					ds := []contract.Delivery{keys.claim("m-snap-a"), keys.claim("m-snap-b")}
					for k := range ds {
						ds[k].MaxAttempts, ds[k].CountFirst, ds[k].Isolation = 3, countFirst, iso
					}
					// The gate (batch_prelock_review_test.go): the insert of the first member's
					// claim waits, after the batch's snapshot, until the test opens it.
					open := gate(t, sch, s, ds[0].Key.MessageID)
					holder := ds[1]
					holder.CountFirst, holder.Isolation = false, sql.LevelReadCommitted
					htx, _ := mustClaim(t, s, holder, contract.Run)

					done := claimBatchAsync(s, ds)
					waitForClaimBlocked(t, sch.Pool)
					if n, err := htx.Fail(ctx, contract.Failure{Counts: true, Error: "boom"}); err != nil || n != 1 {
						t.Fatalf("the holder's Fail: %d, %v; want 1 attempt", n, err)
					}
					open()
					r := <-done
					if r.err != nil {
						t.Fatalf("ClaimBatch: %v", r.err)
					}
					if c := r.cs[1]; c.Decision == contract.Run && c.Attempts != 1 {
						t.Errorf("the member whose key was held: Run with %d earlier attempts, want 1 (or RunAlone)", c.Attempts)
					}
					if c := r.cs[0]; c.Decision != contract.Run || c.Attempts != 0 {
						t.Errorf("the other member: %s with %d earlier attempts, want Run with 0", decisionName(c.Decision), c.Attempts)
					}
					if err := r.bt.Rollback(ctx); err != nil {
						t.Fatalf("Rollback: %v", err)
					}
					alone := ds[1]
					alone.CountFirst = false
					tx, c := mustClaim(t, s, alone, contract.Run)
					if c.Attempts != 1 {
						t.Errorf("the held member claimed alone afterwards: %d earlier attempts, want 1", c.Attempts)
					}
					release(tx)
					for k, d := range ds {
						if n := keyLocks(t, sch.Pool, s, d.Key); n != 0 {
							t.Errorf("member %d: %d advisory locks on the key at the end", k, n)
						}
					}
				})
			}
		}
	}
}

// waitForClaimBlocked waits until a backend's claim statement (queries/claim.sql) waits for a
// lock.
func waitForClaimBlocked(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	waitForBlocked(t, pool, "-- The insert-first claim%", "the batch's claim never waited at the gate")
}

// waitForBlocked waits up to 10 s until a backend whose statement's text is LIKE pattern waits
// for a lock (pg_stat_activity), and fails t with never otherwise.
func waitForBlocked(t *testing.T, pool *pgxpool.Pool, pattern, never string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var n int
		if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1", pattern).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal(never)
}

// batchResult is what a ClaimBatch returned.
type batchResult struct {
	bt  contract.BatchTx
	cs  []contract.Claim
	err error
}

// claimBatchAsync runs s.ClaimBatch(ds) in a goroutine, bounded by 20 s, and returns where its
// result arrives.
func claimBatchAsync(s *pgstore.Store, ds []contract.Delivery) <-chan batchResult {
	done := make(chan batchResult, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		bt, cs, err := s.ClaimBatch(ctx, ds)
		done <- batchResult{bt, cs, err}
	}()
	return done
}
