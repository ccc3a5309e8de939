package pgstore_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestGroupCountCountsEachKeyOnce: many deliveries of distinct keys that count first, claimed
// at the same moment (their counts share the group count's statements, count.go), each end
// with exactly one count in the attempts table while their handlers run; those that commit
// leave no record, those that fail leave one attempt and their error; a second wave of the
// failed ones counts each exactly once more.
func TestGroupCountCountsEachKeyOnce(t *testing.T) {
	const n = 16
	sch := testenv.NewSchema(t, n+4)
	s := sch.Store(t)
	ctx := context.Background()
	ds := make([]contract.Delivery, n)
	for k := range ds {
		ds[k] = countedFirst(plain(fmt.Sprintf("m-%02d", k), "c"), true)
	}
	wave := func(ds []contract.Delivery, earlier int) []contract.Tx {
		t.Helper()
		txs := make([]contract.Tx, len(ds))
		errs := make([]error, len(ds))
		start := make(chan struct{})
		var wg sync.WaitGroup
		for k, d := range ds {
			wg.Go(func() {
				<-start
				cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
				defer cancel()
				tx, c, err := s.Claim(cctx, d)
				if err == nil && (c.Decision != contract.Run || c.Attempts != earlier) {
					release(tx)
					tx, err = nil, fmt.Errorf("decision %s, %d earlier attempts; want Run after %d", decisionName(c.Decision), c.Attempts, earlier)
				}
				txs[k], errs[k] = tx, err
			})
		}
		close(start)
		wg.Wait()
		for k, err := range errs {
			if err != nil {
				for _, tx := range txs {
					release(tx)
				}
				t.Fatalf("claim %d: %v", k, err)
			}
		}
		return txs
	}
	counts := func(ds []contract.Delivery) map[string]int {
		out := map[string]int{}
		for _, d := range ds {
			if a, ok := attemptsRow(t, sch.Pool, s, d.Key); ok {
				out[d.Key.MessageID] = a
			}
		}
		return out
	}
	txs := wave(ds, 0)
	got := counts(ds)
	for _, d := range ds {
		if got[d.Key.MessageID] != 1 {
			t.Errorf("%s: %d counts while its handler runs, want exactly 1", d.Key.MessageID, got[d.Key.MessageID])
		}
	}
	var failed []contract.Delivery
	for k, tx := range txs {
		if k%2 == 0 {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if a, err := tx.Fail(ctx, contract.Failure{Counts: true, Error: "boom"}); err != nil || a != 1 {
			t.Fatalf("fail %d: %d attempts, %v; want 1", k, a, err)
		}
		failed = append(failed, ds[k])
	}
	got = counts(ds)
	for k, d := range ds {
		rows := claimRows(t, sch.Pool, s, d.Key.MessageID)
		switch {
		case k%2 == 0 && (rows != 1 || got[d.Key.MessageID] != 0):
			t.Errorf("%s committed: %d rows, %d attempts; want 1 row and no record", d.Key.MessageID, rows, got[d.Key.MessageID])
		case k%2 == 1 && (rows != 0 || got[d.Key.MessageID] != 1):
			t.Errorf("%s failed: %d rows, %d attempts; want no row and 1 attempt", d.Key.MessageID, rows, got[d.Key.MessageID])
		}
	}
	txs = wave(failed, 1)
	got = counts(failed)
	for _, d := range failed {
		if got[d.Key.MessageID] != 2 {
			t.Errorf("%s: %d counts in the second wave, want 2", d.Key.MessageID, got[d.Key.MessageID])
		}
	}
	for _, tx := range txs {
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if rows, records := rowsAndRecords(t, sch.Pool, s); rows != n || records != 0 {
		t.Fatalf("after every commit: %d rows, %d attempt records; want %d and 0", rows, records, n)
	}
}

// lockRecord holds a row lock on the attempt record of k (FOR UPDATE) in a transaction of its
// own, so that the count of k waits on the server.
func lockRecord(t *testing.T, pool *pgxpool.Pool, s *pgstore.Store, k contract.Key) func(deadLetter bool) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT 1 FROM "+s.AttemptsTable()+" WHERE message_id = $1 AND consumer_name = $2 FOR UPDATE", k.MessageID, k.ConsumerName); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { _ = tx.Rollback(ctx) }) })
	// deadLetter commits the lock's transaction after marking the key dead-lettered (as
	// MarkDeadLettered does), or rolls it back.
	return func(deadLetter bool) {
		once.Do(func() {
			if deadLetter {
				if _, err := tx.Exec(ctx, "UPDATE "+s.AttemptsTable()+" SET dead_lettered_at = now(), dead_letter_reason = 'poison' WHERE message_id = $1 AND consumer_name = $2",
					k.MessageID, k.ConsumerName); err != nil {
					t.Error(err)
				}
				if err := tx.Commit(ctx); err != nil {
					t.Error(err)
				}
				return
			}
			_ = tx.Rollback(ctx)
		})
	}
}

// waitForCountBlocked waits until a backend waits on a lock in the count statement.
func waitForCountBlocked(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	waitForBlocked(t, pool, "-- Counts one attempt%", "the count statement never waited for the locked record")
}

// TestCountSkipsADeadLetteredKey: a key dead-lettered while its count waits for the record's
// row lock (another session marks it dead-lettered; a single claim's count_first.sql, a
// batch's group count after its claims) is not counted: the claim is decided DeadLettered, its
// record keeps its count, and no claim row is left; in a batch the other member is counted,
// runs and commits.
func TestCountSkipsADeadLetteredKey(t *testing.T) {
	for _, batch := range []bool{false, true} {
		t.Run(fmt.Sprintf("batch=%v", batch), func(t *testing.T) {
			sch := testenv.NewSchema(t, 6)
			s := sch.Store(t)
			ctx := context.Background()
			d := countedFirst(plain("m-dl", "c"), true)
			other := countedFirst(plain("a-other", "c"), true)
			tx, _ := mustClaim(t, s, d, contract.Run)
			if _, err := tx.Fail(ctx, contract.Failure{Counts: true, Error: "boom"}); err != nil {
				t.Fatal(err)
			}
			unlock := lockRecord(t, sch.Pool, s, d.Key)
			type result struct {
				cs  []contract.Claim
				bt  contract.BatchTx
				err error
			}
			done := make(chan result, 1)
			go func() {
				cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
				defer cancel()
				if batch {
					bt, cs, err := s.ClaimBatch(cctx, []contract.Delivery{other, d})
					done <- result{cs, bt, err}
					return
				}
				tx, c, err := s.Claim(cctx, d)
				release(tx)
				done <- result{[]contract.Claim{c}, nil, err}
			}()
			waitForCountBlocked(t, sch.Pool)
			unlock(true)
			var r result
			select {
			case r = <-done:
			case <-time.After(15 * time.Second):
				t.Fatal("the claim did not return after the record was unlocked")
			}
			if r.err != nil {
				t.Fatal(r.err)
			}
			if c := r.cs[len(r.cs)-1]; c.Decision != contract.DeadLettered {
				t.Fatalf("the key dead-lettered before its count: %s, want DeadLettered", decisionName(c.Decision))
			}
			if a, _ := attemptsRow(t, sch.Pool, s, d.Key); a != 1 {
				t.Fatalf("the dead-lettered key has %d attempts, want its 1 (not counted)", a)
			}
			if batch {
				if r.cs[0].Decision != contract.Run {
					t.Fatalf("the other member: %s, want Run", decisionName(r.cs[0].Decision))
				}
				if a, _ := attemptsRow(t, sch.Pool, s, other.Key); a != 1 {
					t.Fatalf("the other member has %d counts while it runs, want 1", a)
				}
				if err := r.bt.Healthy(); err != nil {
					t.Fatal(err)
				}
				if err := r.bt.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				if rows := claimRows(t, sch.Pool, s, other.Key.MessageID); rows != 1 {
					t.Fatalf("the other member: %d rows after the commit, want 1", rows)
				}
				if _, ok := attemptsRow(t, sch.Pool, s, other.Key); ok {
					t.Fatal("the other member's record survived its commit")
				}
			}
			if rows := claimRows(t, sch.Pool, s, d.Key.MessageID); rows != 0 {
				t.Fatalf("the dead-lettered key left %d claim rows", rows)
			}
			mustClaim(t, s, d, contract.DeadLettered)
			if a, _ := attemptsRow(t, sch.Pool, s, d.Key); a != 1 {
				t.Fatalf("a claim of the dead-lettered key counted: %d attempts", a)
			}
		})
	}
}
