package pgstore_test

// Adversarial review of the count-first path (count_first.sql in the claim's round trip, the
// key's session lock, clear_counted.sql, the take-backs). Each test asserts the attempt rows,
// the claim rows and pg_locks after the scenario: no advisory lock may outlive its delivery.

import (
	"context"
	"errors"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// keyLocks counts the advisory locks on k's lock (any session, any level) as pg_locks lists
// them: the key's lock is hashtextextended of the table, the consumer name and the message
// ID, separated by a unit separator.
func keyLocks(t testing.TB, q querier, s *pgstore.Store, k contract.Key) int {
	t.Helper()
	var n int
	err := q.QueryRow(context.Background(), `SELECT count(*) FROM pg_locks, (SELECT hashtextextended($1, 0) AS h) k
		WHERE locktype = 'advisory' AND granted AND objsubid = 1
		  AND classid = ((k.h >> 32) & 4294967295)::oid AND objid = (k.h & 4294967295)::oid`,
		s.Table()+"\x1f"+k.ConsumerName+"\x1f"+k.MessageID).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// anyAdvisoryLocks counts the advisory locks held by the backends of the schema's database
// whose search_path is sch's (the test's own connections).
func poolAdvisoryLocks(t testing.TB, pool *pgxpool.Pool) int {
	t.Helper()
	n := 0
	for _, c := range pool.AcquireAllIdle(context.Background()) {
		n += advisoryLocks(t, c)
		c.Release()
	}
	return n
}

// poolWithSession is a pool of conns connections on sch with the session settings in params
// (as a role's or database's default would set them).
func poolWithSession(t *testing.T, sch *testenv.Schema, conns int32, params map[string]string) *pgxpool.Pool {
	t.Helper()
	u, err := url.Parse(sch.URL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	for k, v := range params {
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()
	return testenv.NewPool(t, u.String(), conns)
}

// TestReviewECountThatFailsAfterTakingTheLockLeavesNoLock: the count of a delivery that counts
// first takes the key's session lock in its WHERE, then waits for the attempt record's row,
// which another transaction holds (an operator's UPDATE, a replay, a purge, a commit-time
// Fail on the count connection); the session's lock_timeout (a role's default) ends it with
// SQLSTATE 55P03. The claim fails, counting nothing, and the key's session lock must not stay
// with the pooled connection: if it did, every later claim of the key on another connection
// would find it held and wait until its context ends, for as long as that connection lives.
func TestReviewECountThatFailsAfterTakingTheLockLeavesNoLock(t *testing.T) {
	for _, l := range everyLayout {
		t.Run(l.name, func(t *testing.T) {
			migrated, sch := layoutStore(t, 3, l.cfg)
			pool := poolWithSession(t, sch, 1, map[string]string{"lock_timeout": "200ms"})
			s, err := pgstore.New(pool, migrated.Config())
			if err != nil {
				t.Fatal(err)
			}
			keys := newLayoutKeys(migrated.Config())
			d := keys.claim("m-row-held")
			ctx := context.Background()
			// One failed attempt: the key has a record.
			tx, _ := mustClaim(t, s, d, contract.Run)
			if _, err := tx.Fail(ctx, contract.Failure{Counts: true, Error: "boom"}); err != nil {
				t.Fatal(err)
			}
			if n, ok := attemptsRow(t, sch.Pool, s, d.Key); !ok || n != 1 {
				t.Fatalf("after one failure: %d attempts (record %v), want 1", n, ok)
			}
			// Another transaction holds the record's row.
			side := sideConn(t, sch.URL)
			if _, err := side.Exec(ctx, "BEGIN"); err != nil {
				t.Fatal(err)
			}
			if _, err := side.Exec(ctx, "SELECT 1 FROM "+s.AttemptsTable()+" WHERE message_id = $1 FOR UPDATE", d.Key.MessageID); err != nil {
				t.Fatal(err)
			}
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			tx, _, err = s.Claim(cctx, d)
			cancel()
			release(tx)
			if err == nil {
				t.Fatal("the claim succeeded while the record's row was held past lock_timeout")
			}
			if _, err := side.Exec(ctx, "ROLLBACK"); err != nil {
				t.Fatal(err)
			}
			if n, _ := attemptsRow(t, sch.Pool, s, d.Key); n != 1 {
				t.Errorf("after the failed claim: %d attempts, want 1 (a failed claim counts nothing)", n)
			}
			if n := keyLocks(t, sch.Pool, s, d.Key); n != 0 {
				t.Errorf("%d advisory locks on the key after the failed claim ended, want 0 (claim error: %v)", n, err)
			}
			// A copy on another connection claims the key at once.
			cctx, cancel = context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			tx, c, err := migrated.Claim(cctx, d)
			if err != nil {
				t.Fatalf("a copy on another connection after the failed claim: %v (the key's lock outlived its delivery)", err)
			}
			if c.Decision != contract.Run || c.Attempts != 1 {
				release(tx)
				t.Fatalf("copy: decision %s, attempts %d; want Run after 1", decisionName(c.Decision), c.Attempts)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if _, ok := attemptsRow(t, sch.Pool, s, d.Key); ok {
				t.Error("a processed key kept its attempt record")
			}
			if n := poolAdvisoryLocks(t, pool) + poolAdvisoryLocks(t, sch.Pool); n != 0 {
				t.Errorf("%d advisory locks on idle pooled connections at the end", n)
			}
		})
	}
}

// TestReviewEDeadLetteredKeyWithoutPartitionLeavesNoLock: a redelivery of a dead-lettered
// message whose partition is gone (dropped by retention; dead letters are kept): its count
// takes the key's session lock and counts nothing (the key is dead-lettered), then the claim
// fails with ErrNoPartition. The key's session lock must not stay with the pooled connection.
func TestReviewEDeadLetteredKeyWithoutPartitionLeavesNoLock(t *testing.T) {
	migrated, sch := layoutStore(t, 3, pgstore.Config{Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}})
	pool := testenv.NewPool(t, sch.URL, 1)
	s, err := pgstore.New(pool, migrated.Config())
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	far := time.Now().Add(30 * 24 * time.Hour)
	d := countedFirst(plain(uuid7("far-dead", far), "c"), true)
	if err := s.MarkDeadLettered(ctx, d.Key, "poison"); err != nil {
		t.Fatal(err)
	}
	tx, _, err := s.Claim(ctx, d)
	release(tx)
	if !errors.Is(err, pgstore.ErrNoPartition) {
		t.Fatalf("claim of a dead-lettered key without a partition: %v, want ErrNoPartition", err)
	}
	if n := keyLocks(t, sch.Pool, s, d.Key); n != 0 {
		t.Errorf("%d advisory locks on the key after the failed claim ended, want 0", n)
	}
	var attempts int
	var dead bool
	if err := sch.Pool.QueryRow(ctx, "SELECT attempts, dead_lettered_at IS NOT NULL FROM "+s.AttemptsTable()+" WHERE message_id = $1", d.Key.MessageID).Scan(&attempts, &dead); err != nil {
		t.Fatal(err)
	}
	if attempts != 0 || !dead {
		t.Errorf("record: %d attempts, dead-lettered %v; want 0 and true", attempts, dead)
	}
	// Once the partition exists, a copy on another connection finds the key dead-lettered.
	if _, err := migrated.EnsurePartitions(ctx, far, far); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	tx, c, err := migrated.Claim(cctx, d)
	release(tx)
	if err != nil || c.Decision != contract.DeadLettered {
		t.Fatalf("a copy on another connection: %v, decision %s; want DeadLettered", err, decisionName(c.Decision))
	}
	if n := poolAdvisoryLocks(t, pool) + poolAdvisoryLocks(t, sch.Pool); n != 0 {
		t.Errorf("%d advisory locks on idle pooled connections at the end", n)
	}
}
