package pgstore_test

// Adversarial review of the batch's pre-lock (batchTx.begin: every member's key locked for the
// session by queries/lock_session.sql in a READ COMMITTED transaction of its own, ahead of the
// batch's REPEATABLE READ or SERIALIZABLE snapshot, when counting). Each test asserts the
// inbox rows, the attempt records and pg_locks, not only what the calls return.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// snapshotLevels are the isolation levels under which a counting batch pre-locks its keys.
var snapshotLevels = []sql.IsolationLevel{sql.LevelRepeatableRead, sql.LevelSerializable}

// counting is the delivery of name in keys' layout with attempt counting (maxAttempts),
// counted first when first, at isolation level iso.
func counting(keys layoutKeys, name string, maxAttempts int, first bool, iso sql.IsolationLevel) contract.Delivery {
	d := keys.claim(name)
	d.MaxAttempts, d.CountFirst, d.Isolation = maxAttempts, first, iso
	return d
}

// insertTrigger installs on s's inbox table a BEFORE INSERT trigger named name that runs body
// (PL/pgSQL statements) for the row of message ID id only.
func insertTrigger(t *testing.T, sch *testenv.Schema, s *pgstore.Store, name, id, body string) {
	t.Helper()
	if _, err := sch.Pool.Exec(context.Background(), fmt.Sprintf(`CREATE FUNCTION %[1]s.%[2]s() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN IF NEW.message_id::text = '%[3]s' THEN %[4]s END IF; RETURN NEW; END $$;
		CREATE TRIGGER %[2]s BEFORE INSERT ON %[5]s FOR EACH ROW EXECUTE FUNCTION %[1]s.%[2]s()`,
		sch.Name, name, id, body, s.Table())); err != nil {
		t.Fatal(err)
	}
}

// gate makes the insert of id's claim wait on advisory lock 4243 (after the batch's snapshot
// when id is not its first member, after its pre-locks in any case) and returns the function
// that opens it. The gate is opened when t ends at the latest.
func gate(t *testing.T, sch *testenv.Schema, s *pgstore.Store, id string) (open func()) {
	t.Helper()
	ctx := context.Background()
	g, err := sch.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.Exec(ctx, "SELECT pg_advisory_lock(4243)"); err != nil {
		t.Fatal(err)
	}
	insertTrigger(t, sch, s, "review_gate", id, "PERFORM pg_advisory_xact_lock(4243);")
	var once sync.Once
	open = func() {
		once.Do(func() {
			_, _ = g.Exec(ctx, "SELECT pg_advisory_unlock_all()")
			g.Release()
		})
	}
	t.Cleanup(open)
	return open
}

// waitNoKeyLocks waits up to 5 s until no session holds the lock of any of ds's keys (a closed
// connection's backend releases its locks as it exits, a moment after the close) and fails t
// with what it found otherwise.
func waitNoKeyLocks(t *testing.T, sch *testenv.Schema, s *pgstore.Store, ds []contract.Delivery, when string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		left := 0
		for _, d := range ds {
			left += keyLocks(t, sch.Pool, s, d.Key)
		}
		if left == 0 {
			return
		}
		if time.Now().After(deadline) {
			for _, d := range ds {
				if n := keyLocks(t, sch.Pool, s, d.Key); n != 0 {
					t.Errorf("%s: %d advisory locks on %s's key survive", when, n, d.Key.MessageID)
				}
			}
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestBatchLateMemberIsHeldUntilTheBatchEnds: a counting batch under REPEATABLE READ or
// SERIALIZABLE whose pre-lock of a key failed (a delivery held it) but whose claim of that key
// then took its lock (the holder failed and released it in between) decides the member
// RunAlone and drops its claim row. The batch's transaction still holds that row's index entry
// (its insert and delete are uncommitted), so a claim of the key would wait for the batch on
// the server, holding a pool connection: the batch keeps the key's lock until it ends instead,
// and a claim of the key alone meanwhile waits in process and gives up with ErrClaimInFlight.
// Once the batch has ended the key claimed alone Runs with the holder's attempt (1); no lock on
// either key, no inbox row. Every layout, both levels.
func TestBatchLateMemberIsHeldUntilTheBatchEnds(t *testing.T) {
	for _, l := range everyLayout {
		for _, iso := range snapshotLevels {
			t.Run(fmt.Sprintf("%s/%s", l.name, iso), func(t *testing.T) {
				s, sch := layoutStore(t, 6, l.cfg)
				keys := newLayoutKeys(s.Config())
				ctx := context.Background()
				ds := []contract.Delivery{counting(keys, "m-late-a", 3, false, iso), counting(keys, "m-late-b", 3, false, iso)}
				open := gate(t, sch, s, ds[0].Key.MessageID)
				holder := ds[1]
				holder.Isolation = sql.LevelReadCommitted
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
				defer func() { _ = r.bt.Rollback(ctx) }()
				if r.cs[1].Decision != contract.RunAlone {
					t.Fatalf("the late member: %s (%+v), want RunAlone", decisionName(r.cs[1].Decision), r.cs[1])
				}
				if r.cs[0].Decision != contract.Run || r.cs[0].Attempts != 0 {
					t.Fatalf("the other member: %s with %d earlier attempts, want Run with 0", decisionName(r.cs[0].Decision), r.cs[0].Attempts)
				}
				if n := keyLocks(t, sch.Pool, s, ds[1].Key); n != 1 {
					t.Errorf("the batch is open and decided the late member RunAlone: %d locks on its key, want 1 (the batch's)", n)
				}
				if n := keyLocks(t, sch.Pool, s, ds[0].Key); n != 1 {
					t.Errorf("the batch's running member: %d locks on its key, want 1 (the batch's)", n)
				}
				if rows := claimRows(t, sch.Pool, s, ds[1].Key.MessageID); rows != 0 {
					t.Errorf("the late member's claim row: %d rows visible, want 0", rows)
				}
				alone := ds[1]
				actx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
				tx, c, err := s.Claim(actx, alone)
				cancel()
				release(tx)
				if !errors.Is(err, pgstore.ErrClaimInFlight) {
					t.Errorf("the late member claimed alone while the batch is open: %v, decision %s; want ErrClaimInFlight", err, decisionName(c.Decision))
				}
				if err := r.bt.Rollback(ctx); err != nil {
					t.Fatalf("Rollback: %v", err)
				}
				tx, c = mustClaim(t, s, alone, contract.Run)
				if c.Attempts != 1 {
					t.Errorf("the late member claimed alone after the batch: %d earlier attempts, want the holder's 1", c.Attempts)
				}
				release(tx)
				waitNoKeyLocks(t, sch, s, ds, "after the batch's rollback")
				if n, _ := attemptsRow(t, sch.Pool, s, ds[1].Key); n != 1 {
					t.Errorf("the late member's key: %d attempts, want the holder's 1", n)
				}
				if n, ok := attemptsRow(t, sch.Pool, s, ds[0].Key); ok {
					t.Errorf("the other member: an attempt record (%d) after the rollback, want none", n)
				}
				for _, d := range ds {
					if rows := claimRows(t, sch.Pool, s, d.Key.MessageID); rows != 0 {
						t.Errorf("%s: %d inbox rows after the rollback, want 0", d.Key.MessageID, rows)
					}
				}
			})
		}
	}
}

// TestBatchPreLockedMembersDecidedOtherwise: a counting batch under REPEATABLE READ or
// SERIALIZABLE, counted first and not, whose pre-locks all succeed but whose members' claims
// find a processed key (Duplicate), a dead-lettered key (DeadLettered), a key with
// MaxAttempts failures (Exhausted), a key with one failure and a fresh key (Run with 1 and 0
// earlier attempts). While the batch is open every key is locked by the batch's session alone
// and the members counted first are counted; once committed: the two run members and the
// duplicate have one inbox row each, the others none; the processed keys have no attempt
// record, the dead-lettered and the exhausted keep theirs; no advisory lock survives on any
// key or pool connection. Every layout.
func TestBatchPreLockedMembersDecidedOtherwise(t *testing.T) {
	for _, l := range everyLayout {
		for _, iso := range snapshotLevels {
			for _, first := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/%s/countFirst=%v", l.name, iso, first), func(t *testing.T) {
					s, sch := layoutStore(t, 4, l.cfg)
					keys := newLayoutKeys(s.Config())
					ctx := context.Background()
					d := func(name string) contract.Delivery { return counting(keys, name, 3, first, iso) }
					dup, dead, exh, one, fresh := d("m-dup"), d("m-dead"), d("m-exh"), d("m-one"), d("m-new")
					mustCommit(t, s, counting(keys, "m-dup", 3, false, sql.LevelReadCommitted))
					if err := s.MarkDeadLettered(ctx, dead.Key, "review"); err != nil {
						t.Fatal(err)
					}
					fail := func(name string, times int) {
						for range times {
							tx, _ := mustClaim(t, s, counting(keys, name, 3, false, sql.LevelReadCommitted), contract.Run)
							if _, err := tx.Fail(ctx, contract.Failure{Counts: true, Error: "boom"}); err != nil {
								t.Fatal(err)
							}
						}
					}
					fail("m-exh", 3)
					fail("m-one", 1)
					ds := sortedByKey(dup, dead, exh, one, fresh)
					want := map[string]struct {
						dec      contract.Decision
						attempts int
					}{
						dup.Key.MessageID: {contract.Duplicate, 0}, dead.Key.MessageID: {contract.DeadLettered, 0},
						exh.Key.MessageID: {contract.Exhausted, 3}, one.Key.MessageID: {contract.Run, 1}, fresh.Key.MessageID: {contract.Run, 0},
					}
					bt, cs, err := s.ClaimBatch(ctx, ds)
					if err != nil {
						t.Fatalf("ClaimBatch: %v", err)
					}
					for k, d := range ds {
						w := want[d.Key.MessageID]
						if cs[k].Decision != w.dec || cs[k].Attempts != w.attempts {
							t.Errorf("%s: %s with %d earlier attempts, want %s with %d", d.Key.MessageID, decisionName(cs[k].Decision), cs[k].Attempts, decisionName(w.dec), w.attempts)
						}
						if n := keyLocks(t, sch.Pool, s, d.Key); n != 1 {
							t.Errorf("%s: %d sessions lock its key while the batch is open, want 1 (the batch's)", d.Key.MessageID, n)
						}
					}
					side := sideConn(t, sch.URL)
					wantOne, wantFresh := 1, 0
					if first {
						wantOne, wantFresh = 2, 1
					}
					if n, _ := attemptsRow(t, side, s, one.Key); n != wantOne {
						t.Errorf("m-one while the batch is open: %d attempts, want %d", n, wantOne)
					}
					if n, _ := attemptsRow(t, side, s, fresh.Key); n != wantFresh {
						t.Errorf("m-new while the batch is open: %d attempts, want %d", n, wantFresh)
					}
					if err := bt.Commit(ctx); err != nil {
						t.Fatalf("Commit: %v", err)
					}
					waitNoKeyLocks(t, sch, s, ds, "after the batch's commit")
					if n := poolAdvisoryLocks(t, sch.Pool); n != 0 {
						t.Errorf("pooled connections hold %d advisory locks after the commit", n)
					}
					for name, w := range map[string]struct {
						key     contract.Key
						rows    int
						record  bool
						attempt int
					}{
						"m-dup": {dup.Key, 1, false, 0}, "m-dead": {dead.Key, 0, true, 0}, "m-exh": {exh.Key, 0, true, 3},
						"m-one": {one.Key, 1, false, 0}, "m-new": {fresh.Key, 1, false, 0},
					} {
						if rows := claimRows(t, sch.Pool, s, w.key.MessageID); rows != w.rows {
							t.Errorf("%s: %d inbox rows after the commit, want %d", name, rows, w.rows)
						}
						n, ok := attemptsRow(t, sch.Pool, s, w.key)
						if ok != w.record || n != w.attempt {
							t.Errorf("%s: attempt record %v (%d attempts) after the commit, want %v (%d)", name, ok, n, w.record, w.attempt)
						}
					}
				})
			}
		}
	}
}

// TestBatchPreLocksReleasedOnEveryEnd: the session locks a counting batch takes ahead of its
// REPEATABLE READ or SERIALIZABLE snapshot (and again in its claims) do not outlive the batch
// whatever ends it: a Rollback (counts taken back), a claim statement that fails after the
// pre-locks committed (a trigger raising on the second member's insert), the claim's ctx
// cancelled while the second member's insert waits, and the batch's connection terminated at
// the same point. After each: no session holds any member's key, no attempt record, no inbox
// row, and each key then claims alone (Run, no earlier attempt). Every layout.
func TestBatchPreLocksReleasedOnEveryEnd(t *testing.T) {
	for _, l := range everyLayout {
		for _, iso := range snapshotLevels {
			for _, end := range []string{"rollback", "claim fails", "ctx cancelled", "connection terminated"} {
				t.Run(fmt.Sprintf("%s/%s/%s", l.name, iso, end), func(t *testing.T) {
					s, sch := layoutStore(t, 4, l.cfg)
					keys := newLayoutKeys(s.Config())
					ctx := context.Background()
					ds := sortedByKey(counting(keys, "m-end-a", 3, true, iso), counting(keys, "m-end-b", 3, true, iso), counting(keys, "m-end-c", 3, false, iso))
					second := ds[1].Key.MessageID
					var err error
					switch end {
					case "rollback":
						var bt contract.BatchTx
						var cs []contract.Claim
						bt, cs, err = s.ClaimBatch(ctx, ds)
						if err != nil {
							t.Fatalf("ClaimBatch: %v", err)
						}
						for k := range ds {
							if cs[k].Decision != contract.Run {
								t.Fatalf("member %d: %s, want Run", k, decisionName(cs[k].Decision))
							}
						}
						err = bt.Rollback(ctx)
						if err != nil {
							t.Fatalf("Rollback: %v", err)
						}
					case "claim fails":
						insertTrigger(t, sch, s, "review_fail", second, "RAISE EXCEPTION 'review: refused';")
						_, _, err = s.ClaimBatch(ctx, ds)
						if err == nil {
							t.Fatal("ClaimBatch succeeded past a refused insert")
						}
					default:
						open := gate(t, sch, s, second)
						bctx, cancel := context.WithCancel(ctx)
						defer cancel()
						done := make(chan error, 1)
						go func() {
							_, _, err := s.ClaimBatch(bctx, ds)
							done <- err
						}()
						waitForClaimBlocked(t, sch.Pool)
						if end == "ctx cancelled" {
							cancel()
						} else {
							var pid int
							if err := sch.Pool.QueryRow(ctx, "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '-- The insert-first claim%' LIMIT 1").Scan(&pid); err != nil {
								t.Fatal(err)
							}
							if _, err := sch.Pool.Exec(ctx, "SELECT pg_terminate_backend($1, 5000)", pid); err != nil {
								t.Fatal(err)
							}
						}
						select {
						case err = <-done:
						case <-time.After(10 * time.Second):
							open()
							t.Fatalf("ClaimBatch did not return after the %s", end)
						}
						open()
						if err == nil {
							t.Fatalf("ClaimBatch succeeded after the %s", end)
						}
					}
					waitNoKeyLocks(t, sch, s, ds, "after the batch's "+end)
					for _, d := range ds {
						if n, ok := attemptsRow(t, sch.Pool, s, d.Key); ok {
							t.Errorf("%s: %d attempts after the batch's %s, want no record", d.Key.MessageID, n, end)
						}
						if rows := claimRows(t, sch.Pool, s, d.Key.MessageID); rows != 0 {
							t.Errorf("%s: %d inbox rows after the batch's %s", d.Key.MessageID, rows, end)
						}
					}
					if _, err := sch.Pool.Exec(ctx, "DROP TRIGGER IF EXISTS review_fail ON "+s.Table()+"; DROP TRIGGER IF EXISTS review_gate ON "+s.Table()); err != nil {
						t.Fatal(err)
					}
					for _, d := range ds {
						alone := d
						alone.CountFirst = false
						tx, c := mustClaim(t, s, alone, contract.Run)
						if c.Attempts != 0 {
							t.Errorf("%s claimed alone afterwards: %d earlier attempts, want 0", d.Key.MessageID, c.Attempts)
						}
						release(tx)
					}
					waitNoKeyLocks(t, sch, s, ds, "after the claims alone")
				})
			}
		}
	}
}

// TestBatchesAndClaimsRaceOnOverlappingKeys: batches of two or three of five keys (in key order,
// as the inbox sends them, counted first or not) and single claims of the same keys race for
// about a second under REPEATABLE READ or SERIALIZABLE, with counting. Every run member and
// claim fails with an attempt that counts (Drop, Fail) or, now and then, commits. A model of
// the attempts, updated before the next holder of the key can check it, must match every decision: a member or a
// claim that Runs finds exactly the failures recorded so far as its earlier attempts (a
// snapshot earlier than the last holder's record would show fewer), Drop and Fail return one
// more, and no key runs once it was committed. At the end: no advisory lock on any key; a
// committed key has one inbox row and no attempt record, any other none and the model's count.
// Every layout.
func TestBatchesAndClaimsRaceOnOverlappingKeys(t *testing.T) {
	for _, l := range everyLayout {
		for _, iso := range snapshotLevels {
			t.Run(fmt.Sprintf("%s/%s", l.name, iso), func(t *testing.T) {
				s, sch := layoutStore(t, 8, l.cfg)
				keys := newLayoutKeys(s.Config())
				ctx := context.Background()
				names := []string{"m-race-1", "m-race-2", "m-race-3", "m-race-4", "m-race-5"}
				var mu sync.Mutex
				attempts := map[string]int{} // by name: the failures recorded
				processed := map[string]bool{}
				committing := map[string]int{} // by name: batches committing it, outcome not known yet
				var runs, dups, alone int
				check := func(name string, c contract.Claim, who string) bool {
					mu.Lock()
					defer mu.Unlock()
					switch c.Decision {
					case contract.Run:
						runs++
						if processed[name] {
							t.Errorf("%s: %s ran a key already committed", name, who)
						}
						if c.Attempts != attempts[name] {
							t.Errorf("%s: %s ran with %d earlier attempts, want %d", name, who, c.Attempts, attempts[name])
						}
						return true
					case contract.Duplicate:
						dups++
						if !processed[name] && committing[name] == 0 {
							t.Errorf("%s: %s found a duplicate of a key not committed", name, who)
						}
					case contract.RunAlone:
						alone++
					default:
						t.Errorf("%s: %s decided %s", name, who, decisionName(c.Decision))
					}
					return false
				}
				// failed runs fail (a Drop, or a Fail that releases the key before it returns)
				// under mu, so that the model moves before the next holder of the key checks.
				failed := func(name string, k contract.Key, who string, fail func() (int, error)) {
					mu.Lock()
					defer mu.Unlock()
					n, err := fail()
					if err != nil {
						// Drop records first, then deletes the claim, which may fail under
						// SERIALIZABLE (40001): the record stands; read it while still holding
						// the key.
						if s.Classify(err) != contract.Retryable {
							t.Errorf("%s: %s's failure: %v", name, who, err)
							return
						}
						n, _ = attemptsRow(t, sch.Pool, s, k)
					}
					if n != attempts[name]+1 {
						t.Errorf("%s: %s's failure recorded %d attempts, want %d", name, who, n, attempts[name]+1)
					}
					attempts[name] = n
				}
				tolerable := func(err error) bool {
					return s.Classify(err) == contract.Retryable || errors.Is(err, pgstore.ErrClaimInFlight) || errors.Is(err, context.DeadlineExceeded)
				}
				stop := time.Now().Add(time.Second)
				var wg sync.WaitGroup
				for w := range 3 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						rng := rand.New(rand.NewPCG(uint64(w), 7))
						for time.Now().Before(stop) && !t.Failed() {
							perm := rng.Perm(len(names))[:2+rng.IntN(2)]
							first := rng.IntN(2) == 0
							var ds []contract.Delivery
							for _, p := range perm {
								ds = append(ds, counting(keys, names[p], 1000, first, iso))
							}
							ds = sortedByKey(ds...)
							byID := map[string]string{}
							for _, n := range names {
								byID[keys.id(n)] = n
							}
							cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
							bt, cs, err := s.ClaimBatch(cctx, ds)
							cancel()
							if err != nil {
								if !tolerable(err) {
									t.Errorf("batch claim: %v", err)
								}
								continue
							}
							commit := rng.IntN(25) == 0
							var ran []string
							for k, d := range ds {
								name := byID[d.Key.MessageID]
								if !check(name, cs[k], "a batch") {
									continue
								}
								ran = append(ran, name)
								if !commit {
									failed(name, d.Key, "a batch", func() (int, error) {
										return bt.Drop(ctx, k, contract.Failure{Counts: true, Error: "boom"})
									})
								}
							}
							if !commit {
								if err := bt.Rollback(ctx); err != nil {
									t.Errorf("batch rollback: %v", err)
								}
								continue
							}
							mu.Lock()
							for _, n := range ran {
								committing[n]++
							}
							mu.Unlock()
							err = bt.Commit(ctx)
							if err != nil && !tolerable(err) {
								t.Errorf("batch commit: %v", err)
							}
							mu.Lock()
							for _, n := range ran {
								committing[n]--
								processed[n] = processed[n] || err == nil
							}
							mu.Unlock()
						}
					}()
				}
				for w := range 2 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						rng := rand.New(rand.NewPCG(uint64(w), 11))
						for time.Now().Before(stop) && !t.Failed() {
							name := names[rng.IntN(len(names))]
							d := counting(keys, name, 1000, rng.IntN(2) == 0, iso)
							cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
							tx, c, err := s.Claim(cctx, d)
							cancel()
							if err != nil {
								if !tolerable(err) {
									t.Errorf("claim %s: %v", name, err)
								}
								continue
							}
							if !check(name, c, "a single claim") {
								continue
							}
							failed(name, d.Key, "a single claim", func() (int, error) {
								return tx.Fail(ctx, contract.Failure{Counts: true, Error: "boom"})
							})
						}
					}()
				}
				wg.Wait()
				t.Logf("%d runs, %d duplicates, %d run alone", runs, dups, alone)
				var all []contract.Delivery
				for _, n := range names {
					all = append(all, counting(keys, n, 1000, false, iso))
				}
				waitNoKeyLocks(t, sch, s, all, "after the race")
				for _, n := range names {
					k := counting(keys, n, 1000, false, iso).Key
					rows := claimRows(t, sch.Pool, s, k.MessageID)
					got, ok := attemptsRow(t, sch.Pool, s, k)
					switch {
					case processed[n] && (rows != 1 || ok):
						t.Errorf("%s, committed: %d inbox rows and attempt record %v (%d); want 1 row, no record", n, rows, ok, got)
					case !processed[n] && (rows != 0 || got != attempts[n]):
						t.Errorf("%s: %d inbox rows and %d attempts; want 0 rows and %d attempts", n, rows, got, attempts[n])
					}
				}
			})
		}
	}
}
