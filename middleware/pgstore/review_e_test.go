package pgstore_test

// Adversarial review of the count-first path (count_first.sql in the claim's round trip, the
// key's session lock, clear_counted.sql, the take-backs). Each test asserts the attempt rows,
// the claim rows and pg_locks after the scenario: no advisory lock may outlive its delivery.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
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

// TestReviewECopiesOnEveryIsolationLevel: copies of a few keys, delivered concurrently on a
// small pool by workers that each pick at random whether the delivery counts first or is a
// first delivery, its isolation level, and how its handler ends (an error, an error that is
// not the message's, a statement that aborts the transaction, or a write and a commit). No
// two handlers of one key ever run at once; afterwards every processed key has exactly one
// claim row, its one business write and no attempt record, every other key's record counts
// exactly the handler runs that failed as the message's own, and no advisory lock is held.
func TestReviewECopiesOnEveryIsolationLevel(t *testing.T) {
	for _, l := range everyLayout {
		t.Run(l.name, func(t *testing.T) {
			testCopiesOnEveryIsolationLevel(t, l.cfg)
		})
	}
}

func testCopiesOnEveryIsolationLevel(t *testing.T, cfg pgstore.Config) {
	s, sch := layoutStore(t, 6, cfg)
	sch.Exec(t, "CREATE TABLE effects_e (id text)")
	keys := newLayoutKeys(s.Config())
	const nKeys, workers, rounds = 3, 8, 40
	type keyState struct {
		d        contract.Delivery
		inFlight atomic.Int32
		failed   atomic.Int32 // handler runs that failed as the message's own
		done     atomic.Bool  // committed, or committing
		log      copyLog
	}
	states := make([]*keyState, nKeys)
	for i := range states {
		d := keys.claim(fmt.Sprintf("m-copies-%d", i))
		d.MaxAttempts = 1 << 20
		states[i] = &keyState{d: d}
	}
	isos := []sql.IsolationLevel{sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable}
	var wg sync.WaitGroup
	var errs atomic.Int32
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for range rounds {
				st := states[rng.IntN(nKeys)]
				d := st.d
				d.CountFirst = rng.IntN(2) == 0
				d.Isolation = isos[rng.IntN(len(isos))]
				outcome := 7 // commit
				switch r := rng.IntN(20); {
				case r < 12:
					outcome = 0
				case r < 15:
					outcome = 5
				case r < 18 && d.CountFirst:
					// A failed statement only in deliveries counted first: a first
					// delivery's aborted transaction releases the key before its Fail
					// (see the review's report).
					outcome = 6
				case r < 18:
					outcome = 0
				}
				if err := deliverCopy(s, d, w, outcome, &st.inFlight, &st.failed, &st.done, &st.log); err != nil {
					if errs.Add(1) < 5 {
						t.Errorf("%v\n%s", err, st.log.String())
					}
				}
			}
		}()
	}
	wg.Wait()
	ctx := context.Background()
	for _, st := range states {
		k := st.d.Key
		n, ok := attemptsRow(t, sch.Pool, s, k)
		var effects int
		if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM effects_e WHERE id = $1", k.MessageID).Scan(&effects); err != nil {
			t.Fatal(err)
		}
		rows := claimRows(t, sch.Pool, s, k.MessageID)
		if st.done.Load() {
			if ok || rows != 1 || effects != 1 {
				t.Errorf("%s processed: attempt record %v (%d), %d claim rows, %d effects; want none, 1, 1", k.MessageID, ok, n, rows, effects)
			}
		} else if rows != 0 || effects != 0 || n != int(st.failed.Load()) {
			t.Errorf("%s not processed: %d claim rows, %d effects, %d attempts; want 0, 0, %d", k.MessageID, rows, effects, n, st.failed.Load())
		}
		if l := keyLocks(t, sch.Pool, s, k); l != 0 {
			t.Errorf("%s: %d advisory locks on the key at the end", k.MessageID, l)
		}
	}
}

// deliverCopy is one delivery of d: outcome < 5 fails with the message's own error, 5 with
// one that is not (a transient conflict), 6 aborts the transaction with a failed statement
// and fails, anything else writes and commits.
func deliverCopy(s *pgstore.Store, d contract.Delivery, w, outcome int, inFlight, failed *atomic.Int32, done *atomic.Bool, log *copyLog) error {
	ctx := context.Background()
	for {
		log.add("w%d claim first=%v iso=%d outcome=%d", w, d.CountFirst, d.Isolation, outcome)
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		tx, c, err := s.Claim(cctx, d)
		cancel()
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01") {
			continue // a transient conflict on the claim: nothing was counted
		}
		if err != nil {
			return fmt.Errorf("claim %s: %w", d.Key.MessageID, err)
		}
		if c.Decision == contract.Duplicate {
			if !done.Load() {
				return fmt.Errorf("%s: a duplicate of a key not processed", d.Key.MessageID)
			}
			return nil
		}
		if c.Decision != contract.Run {
			return fmt.Errorf("%s: decision %s (%+v)", d.Key.MessageID, decisionName(c.Decision), c)
		}
		log.add("w%d   run: %d earlier", w, c.Attempts)
		if n := inFlight.Add(1); n != 1 {
			inFlight.Add(-1)
			release(tx)
			return fmt.Errorf("%s: %d handlers at once", d.Key.MessageID, n)
		}
		if int(failed.Load()) != c.Attempts {
			inFlight.Add(-1)
			release(tx)
			return fmt.Errorf("%s: the claim found %d earlier attempts, want %d", d.Key.MessageID, c.Attempts, failed.Load())
		}
		ptx, _ := pgstore.TxFromContext(tx.Context(ctx))
		var n int
		switch {
		case outcome < 5:
			inFlight.Add(-1)
			failed.Add(1)
			n, err = tx.Fail(ctx, contract.Failure{Counts: true, Error: "boom"})
		case outcome == 5:
			inFlight.Add(-1)
			n, err = tx.Fail(ctx, contract.Failure{})
		case outcome == 6:
			_, _ = ptx.Exec(ctx, "SELECT 1/0")
			inFlight.Add(-1)
			failed.Add(1)
			n, err = tx.Fail(ctx, contract.Failure{Counts: true, Error: "division by zero"})
		default:
			if _, err := ptx.Exec(ctx, "INSERT INTO effects_e VALUES ($1)", d.Key.MessageID); err != nil {
				inFlight.Add(-1)
				release(tx)
				return err
			}
			inFlight.Add(-1)
			done.Store(true)
			if err = tx.Commit(ctx); err == nil {
				log.add("w%d   committed", w)
				return nil
			}
			done.Store(false)
			log.add("w%d   commit: %v", w, err)
			if errors.As(err, &pgErr) && pgErr.Code == "40001" {
				n, err = tx.Fail(ctx, contract.Failure{})
				if err == nil {
					continue
				}
			}
		}
		log.add("w%d   failed: %d attempts, %v", w, n, err)
		return err
	}
}

// copyLog is what happened to one key, in order.
type copyLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *copyLog) add(format string, args ...any) {
	l.mu.Lock()
	l.lines = append(l.lines, fmt.Sprintf(format, args...))
	l.mu.Unlock()
}

func (l *copyLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

// TestReviewEEveryDecisionButRunTakesItsCountBack: a delivery counted first that is not run
// (Exhausted, RunAlone with Isolate, DeadLettered, Duplicate, Collision), on every layout and
// isolation level, leaves the key's record as it found it (a processed key: none), the claim
// rows as they were, and no advisory lock.
func TestReviewEEveryDecisionButRunTakesItsCountBack(t *testing.T) {
	isos := []sql.IsolationLevel{sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable}
	for _, l := range everyLayout {
		t.Run(l.name, func(t *testing.T) {
			s, sch := layoutStore(t, 3, l.cfg)
			keys := newLayoutKeys(s.Config())
			ctx := context.Background()
			for _, iso := range isos {
				name := func(what string) string { return fmt.Sprintf("m-%s-%d", what, iso) }
				type record struct {
					attempts int
					lastErr  *string
					dead     bool
					ok       bool
				}
				read := func(k contract.Key) record {
					var r record
					err := sch.Pool.QueryRow(ctx, "SELECT attempts, last_error, dead_lettered_at IS NOT NULL FROM "+s.AttemptsTable()+
						" WHERE message_id = $1 AND consumer_name = $2", k.MessageID, k.ConsumerName).Scan(&r.attempts, &r.lastErr, &r.dead)
					r.ok = err == nil
					return r
				}
				fail := func(d contract.Delivery, counts bool, errText string) {
					tx, _ := mustClaim(t, s, d, contract.Run)
					if _, err := tx.Fail(ctx, contract.Failure{Counts: counts, Error: errText}); err != nil {
						t.Fatal(err)
					}
				}
				// Exhausted: MaxAttempts (3) failures.
				ex := keys.claim(name("exhausted"))
				ex.Isolation = iso
				for range ex.MaxAttempts {
					fail(ex, true, "boom")
				}
				// RunAlone: one attempt that ended unsettled, no error (a crash): a count
				// made first and never settled, as a killed consumer leaves it.
				alone := keys.claim(name("alone"))
				alone.Isolation = iso
				sch.Exec(t, "INSERT INTO "+s.AttemptsTable()+" (message_id, consumer_name, attempts) VALUES ($1, $2, 1)", alone.Key.MessageID, alone.Key.ConsumerName)
				alone.Isolate = true
				// DeadLettered.
				dead := keys.claim(name("dead"))
				dead.Isolation = iso
				fail(dead, true, "first")
				if err := s.MarkDeadLettered(ctx, dead.Key, "poison"); err != nil {
					t.Fatal(err)
				}
				// Duplicate (with a stale record of the processed key, which it removes) and
				// Collision (another payload).
				dup := keys.claim(name("dup"))
				dup.Isolation = iso
				mustCommit(t, s, dup)
				col := dup
				col.PayloadHash = payloadHash("other")
				for _, c := range []struct {
					d     contract.Delivery
					want  contract.Decision
					after func(before record) record
				}{
					{ex, contract.Exhausted, nil},
					{alone, contract.RunAlone, nil},
					{dead, contract.DeadLettered, nil},
					{dup, contract.Duplicate, func(record) record { return record{} }},
					{col, contract.Collision, func(record) record { return record{} }},
				} {
					before := read(c.d.Key)
					rows := claimRows(t, sch.Pool, s, c.d.Key.MessageID)
					mustClaim(t, s, c.d, c.want)
					want := before
					if c.after != nil {
						want = c.after(before)
					}
					got := read(c.d.Key)
					if got.ok != want.ok || got.attempts != want.attempts || got.dead != want.dead || (got.lastErr == nil) != (want.lastErr == nil) ||
						(got.lastErr != nil && *got.lastErr != *want.lastErr) {
						t.Errorf("%s %s: record %+v after, want %+v", c.d.Key.MessageID, decisionName(c.want), got, want)
					}
					if r := claimRows(t, sch.Pool, s, c.d.Key.MessageID); r != rows {
						t.Errorf("%s %s: %d claim rows after, %d before", c.d.Key.MessageID, decisionName(c.want), r, rows)
					}
					if n := keyLocks(t, sch.Pool, s, c.d.Key); n != 0 {
						t.Errorf("%s %s: %d advisory locks on the key after", c.d.Key.MessageID, decisionName(c.want), n)
					}
				}
			}
			if n := poolAdvisoryLocks(t, sch.Pool); n != 0 {
				t.Errorf("%d advisory locks on idle pooled connections at the end", n)
			}
		})
	}
}

// TestReviewELostAnswerTakesBackOnlyItsOwnCount: the answer to the claim's round trip of a
// delivery counted first is lost (a network partition after the request) for a key with two
// earlier failures and a last error. The server process is ended and the count taken back by
// its token: the record is the one before, last error included, and no lock is left.
func TestReviewELostAnswerTakesBackOnlyItsOwnCount(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	direct := sch.Store(t)
	s, _, p := review3ProxiedStore(t, sch, "review-e-lost")
	ctx := context.Background()
	d := countedFirst(plain("m-lost-earlier", "c"), true)
	d.MaxAttempts, d.FinishTimeout = 5, time.Second
	for _, e := range []string{"first", "second"} {
		tx, _ := mustClaim(t, direct, d, contract.Run)
		if _, err := tx.Fail(ctx, contract.Failure{Counts: true, Error: e}); err != nil {
			t.Fatal(err)
		}
	}
	mustCommit(t, s, countedFirst(plain("warm", "c"), true)) // one connection through the proxy
	p.Hold()
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	tx, _, err := s.Claim(cctx, d)
	cancel()
	release(tx)
	if err == nil || tx != nil {
		t.Fatal("the claim succeeded without an answer")
	}
	var attempts int
	var lastErr string
	if err := sch.Pool.QueryRow(ctx, "SELECT attempts, last_error FROM "+direct.AttemptsTable()+" WHERE message_id = $1", d.Key.MessageID).Scan(&attempts, &lastErr); err != nil {
		t.Fatal(err)
	}
	if attempts != 2 || lastErr != "second" {
		t.Errorf("after the lost claim: %d attempts, last error %q; want 2 and \"second\"", attempts, lastErr)
	}
	if n := keyLocks(t, sch.Pool, direct, d.Key); n != 0 {
		t.Errorf("%d advisory locks on the key after the lost claim", n)
	}
	tx, c := mustClaim(t, direct, d, contract.Run)
	release(tx)
	if c.Attempts != 2 {
		t.Errorf("the next delivery found %d earlier attempts, want 2", c.Attempts)
	}
}

// TestReviewEFailedStatementOfAFirstDeliveryKeepsItsKey: a counting delivery that its broker
// marks as a first delivery (not counted first) runs its handler, whose statement fails (a
// unique violation, a division by zero: the transaction is aborted, and PostgreSQL releases
// its transaction-level locks at once). Until that delivery's Fail has recorded the attempt,
// a copy (counted first or a first delivery, on any isolation level) must find the key held:
// otherwise it runs its handler beside the first one's and reads the count one short, and
// with MaxAttempts 1 the message runs twice instead of being dead-lettered.
func TestReviewEFailedStatementOfAFirstDeliveryKeepsItsKey(t *testing.T) {
	isos := []sql.IsolationLevel{sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable}
	for _, l := range everyLayout {
		for _, iso := range isos {
			for _, copyFirst := range []bool{true, false} {
				t.Run(fmt.Sprintf("%s/%s/copy-counted-first=%v", l.name, iso, copyFirst), func(t *testing.T) {
					s, sch := layoutStore(t, 4, l.cfg)
					keys := newLayoutKeys(s.Config())
					ctx := context.Background()
					a := keys.claim("m-aborted")
					a.MaxAttempts, a.CountFirst, a.Isolation = 1, false, iso
					tx, _ := mustClaim(t, s, a, contract.Run)
					defer release(tx)
					if _, err := handlerTx(t, tx).Exec(ctx, "SELECT 1/0"); err == nil {
						t.Fatal("SELECT 1/0 succeeded")
					}
					b := a
					b.CountFirst = copyFirst
					cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
					btx, c, err := s.Claim(cctx, b)
					cancel()
					release(btx)
					if !errors.Is(err, pgstore.ErrClaimInFlight) {
						t.Errorf("a copy while the first delivery's failed handler has not ended: %v, decision %s with %d earlier attempts; want ErrClaimInFlight",
							err, decisionName(c.Decision), c.Attempts)
					}
					if n, _ := attemptsRow(t, sch.Pool, s, a.Key); n != 0 {
						t.Errorf("%d attempts recorded while the first delivery is in flight, want 0 (a copy that waits is no attempt)", n)
					}
					if n, err := tx.Fail(ctx, contract.Failure{Counts: true, Error: "division by zero"}); err != nil || n != 1 {
						t.Fatalf("Fail: %d, %v; want 1", n, err)
					}
					_, c = mustClaim(t, s, b, contract.Exhausted)
					if c.Attempts != 1 {
						t.Errorf("the copy after the failure: %d earlier attempts, want 1", c.Attempts)
					}
					if n, _ := attemptsRow(t, sch.Pool, s, a.Key); n != 1 {
						t.Errorf("%d attempts at the end, want 1", n)
					}
					if n := keyLocks(t, sch.Pool, s, a.Key); n != 0 {
						t.Errorf("%d advisory locks on the key at the end", n)
					}
				})
			}
		}
	}
}

// TestBatchMemberFailedStatementKeepsTheKeys: the batched mode's form of
// TestReviewEFailedStatementOfAFirstDeliveryKeepsItsKey. A counting batch of two first
// deliveries; a statement of the first member's handler fails, which aborts the batch's
// transaction (PostgreSQL releases its transaction-level locks at once). Until the batch has
// recorded that member's failure and ended, a copy of either member must find its key held;
// afterwards the failed member's copy reads its one attempt (Exhausted with MaxAttempts 1),
// and no advisory lock is left.
func TestBatchMemberFailedStatementKeepsTheKeys(t *testing.T) {
	for _, l := range everyLayout {
		for _, iso := range []sql.IsolationLevel{sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable} {
			t.Run(fmt.Sprintf("%s/%s", l.name, iso), func(t *testing.T) {
				s, sch := layoutStore(t, 4, l.cfg)
				keys := newLayoutKeys(s.Config())
				ctx := context.Background()
				ds := []contract.Delivery{keys.claim("m-batch-a"), keys.claim("m-batch-b")}
				for k := range ds {
					ds[k].MaxAttempts, ds[k].CountFirst, ds[k].Isolation = 1, false, iso
				}
				bt, cs, err := s.ClaimBatch(ctx, ds)
				if err != nil {
					t.Fatal(err)
				}
				for k, c := range cs {
					if c.Decision != contract.Run {
						t.Fatalf("member %d: %s, want Run", k, decisionName(c.Decision))
					}
				}
				ptx, ok := pgstore.TxFromContext(bt.Context(ctx))
				if !ok {
					t.Fatal("no transaction in the batch's context")
				}
				if _, err := ptx.Exec(ctx, "SELECT 1/0"); err == nil {
					t.Fatal("SELECT 1/0 succeeded")
				}
				for k, d := range ds {
					cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
					tx, c, err := s.Claim(cctx, d)
					cancel()
					release(tx)
					if !errors.Is(err, pgstore.ErrClaimInFlight) {
						t.Errorf("a copy of member %d while the aborted batch is in flight: %v, decision %s; want ErrClaimInFlight", k, err, decisionName(c.Decision))
					}
				}
				if _, err := bt.Drop(ctx, 0, contract.Failure{Counts: true, Error: "division by zero"}); err != nil {
					t.Fatalf("Drop: %v", err)
				}
				if err := bt.Rollback(ctx); err != nil {
					t.Fatalf("Rollback: %v", err)
				}
				if _, c := mustClaim(t, s, ds[0], contract.Exhausted); c.Attempts != 1 {
					t.Errorf("the failed member's copy: %d earlier attempts, want 1", c.Attempts)
				}
				tx, c := mustClaim(t, s, ds[1], contract.Run)
				if c.Attempts != 0 {
					t.Errorf("the other member's copy: %d earlier attempts, want 0", c.Attempts)
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
