package pgstore_test

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/binary"
	"errors"
	"fmt"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
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

// TestHandlerLockTimeoutEverywhere: with a session lock_timeout of 7s (a role's
// default), on every layout, claim path and isolation level, with and without
// StatementTimeout, the handler runs under 7s, never the claim's 2 ms; and after a claim, a
// duplicate, a dead-lettered key and a claim that gave up behind a claim in flight, the pooled
// connection's next user finds lock_timeout 7s.
func TestHandlerLockTimeoutEverywhere(t *testing.T) {
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
						p := keys.claim(name)
						p.PayloadHash = make([]byte, 32)
						p.Isolation = iso
						tx, claimed, err := path.claim(ctx, s, p)
						if err != nil || !claimed {
							t.Fatalf("%s: claim: %v %v", name, err, claimed)
						}
						var lt string
						if err := handlerTx(t, tx).QueryRow(ctx, "SELECT current_setting('lock_timeout')").Scan(&lt); err != nil {
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
						q := keys.claim(name + "-held")
						q.PayloadHash = make([]byte, 32)
						q.Isolation = iso
						held, _ := mustClaim(t, holder, q, contract.Run)
						cctx, cancel := context.WithTimeout(ctx, 60*time.Millisecond)
						_, _, err = path.claim(cctx, s, q)
						cancel()
						// Fail that does not count takes the holder's count back.
						if _, err := held.Fail(ctx, contract.Failure{}); err != nil {
							t.Fatal(err)
						}
						if !errors.Is(err, pgstore.ErrClaimInFlight) {
							t.Errorf("%s: claim behind a claim in flight: %v, want ErrClaimInFlight", name, err)
						}
						check(name + " after ErrClaimInFlight")
					}
				}
				// A dead-lettered key.
				dl := keys.claim(fmt.Sprintf("dead-%s", stmt))
				dl.PayloadHash = make([]byte, 32)
				if err := s.MarkDeadLettered(ctx, dl.Key, "x"); err != nil {
					t.Fatal(err)
				}
				for _, cf := range []bool{true, false} {
					dl.CountFirst = cf
					mustClaim(t, s, dl, contract.DeadLettered)
					check("after a dead-lettered key")
				}
				// Batches, counted or not, counting first or not.
				for _, counted := range []bool{false, true} {
					for _, cf := range []bool{false, true} {
						for _, iso := range isos {
							var ds []contract.Delivery
							for m := range 3 {
								c := keys.claim(fmt.Sprintf("batch-%v-%v-%d-%d-%s", counted, cf, iso, m, stmt))
								c.PayloadHash = make([]byte, 32)
								c.Isolation = iso
								c.CountFirst = cf && m != 1
								if !counted {
									c.MaxAttempts, c.CountFirst = 0, false
								}
								ds = append(ds, c)
							}
							ds = sortedByKey(ds...)
							bt, cs, err := s.ClaimBatch(ctx, ds)
							if err != nil {
								t.Fatal(err)
							}
							for k, c := range cs {
								if c.Decision != contract.Run {
									t.Fatalf("batch member %d: %s, want Run", k, decisionName(c.Decision))
								}
							}
							var lt string
							if err := handlerTx(t, bt).QueryRow(ctx, "SELECT current_setting('lock_timeout')").Scan(&lt); err != nil {
								t.Fatal(err)
							}
							if lt != sessionLockTimeout {
								t.Errorf("batch counted=%v countFirst=%v iso=%d: handlers run under lock_timeout %q, want %q", counted, cf, iso, lt, sessionLockTimeout)
							}
							if err := bt.Commit(ctx); err != nil {
								t.Fatal(err)
							}
							check("after a batch")
							bt, cs, err = s.ClaimBatch(ctx, ds)
							if err != nil {
								t.Fatal(err)
							}
							for k, c := range cs {
								if c.Decision != contract.Duplicate {
									t.Fatalf("batch member %d claimed twice: %s", k, decisionName(c.Decision))
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

// TestClaimBehindAClaimInFlightAlwaysSaysSo: a claim whose key stays held by a delivery in
// flight until its context ends fails with ErrClaimInFlight every time, however the end of its
// context falls against its pauses: never with ErrWaitingForConnection ("0 of N connections
// in use") or a bare deadline when its last pause ended just as the context did. Each try's
// context ends at a different moment of the pause schedule. A batch with that key never
// waits: the member is decided RunAlone. Nothing is counted.
func TestClaimBehindAClaimInFlightAlwaysSaysSo(t *testing.T) {
	for _, l := range []struct {
		name string
		cfg  pgstore.Config
	}{everyLayout[0], everyLayout[1]} {
		t.Run(l.name, func(t *testing.T) {
			s, sch := layoutStore(t, 3, l.cfg)
			keys := newLayoutKeys(s.Config())
			ctx := context.Background()
			p := keys.claim("held")
			p.PayloadHash = make([]byte, 32)
			p.MaxAttempts, p.CountFirst = 0, false // the holder counts nothing
			held, _ := mustClaim(t, s, p, contract.Run)
			defer release(held)
			p = countedFirst(p, true)
			// Warm both free connections up (connected, statements prepared): a first try
			// may wait for a new connection or a slow prepare on a busy machine, which is no
			// lock wait.
			for round := range 3 {
				var wg sync.WaitGroup
				for c := range 2 {
					wg.Go(func() {
						w := keys.claim(fmt.Sprintf("warm-%d-%d", round, c))
						w.PayloadHash = make([]byte, 32)
						if tx, _, err := s.Claim(ctx, w); err == nil {
							release(tx)
						}
						if bt, _, err := s.ClaimBatch(ctx, []contract.Delivery{w}); err == nil {
							_ = bt.Rollback(ctx)
						}
					})
				}
				wg.Wait()
			}
			wrong := 0
			for i := range 40 {
				d := time.Duration(30+2*i) * time.Millisecond
				cctx, cancel := context.WithTimeout(ctx, d)
				if i%4 == 3 {
					bt, cs, err := s.ClaimBatch(cctx, []contract.Delivery{p})
					if err != nil || cs[0].Decision != contract.RunAlone {
						wrong++
						t.Errorf("try %d: batch %v %+v, want the held member decided RunAlone", i, err, cs)
					} else {
						_ = bt.Rollback(ctx)
					}
				} else {
					_, _, err := s.Claim(cctx, p)
					if !errors.Is(err, pgstore.ErrClaimInFlight) || !errors.Is(err, context.DeadlineExceeded) {
						wrong++
						t.Errorf("try %d (context %s): %v; want ErrClaimInFlight and the deadline", i, d, err)
					}
				}
				cancel()
			}
			if n, ok := attemptsRow(t, sch.Pool, s, p.Key); ok {
				t.Fatalf("%d attempts recorded, want no record: waits are not attempts", n)
			}
			t.Logf("%d of 40 tries misreported", wrong)
		})
	}
}

// TestMigratedCompactRowsPurgeAndHashes: a first-version compact table (plain and
// partitioned) holding rows received at known seconds of one minute and the next, with
// payload hashes whose first byte has its high bit set (negative as an integer), is migrated
// by 0003; then each row's duplicate still reports the first 2 bytes of its own hash, another
// payload is told apart, and purge never deletes a row received at or after Before (minute
// resolution may only keep rows longer).
func TestMigratedCompactRowsPurgeAndHashes(t *testing.T) {
	ctx := context.Background()
	for _, part := range []bool{false, true} {
		t.Run(fmt.Sprintf("partitioned=%v", part), func(t *testing.T) {
			cfg := pgstore.Config{Layout: pgstore.LayoutCompact}
			if part {
				cfg.Partitioning = &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}
			}
			v1 := newFirstVersionCompact(t, cfg)
			s, sch, now := v1.s, v1.sch, v1.now
			minute := now.Add(-3 * time.Hour).Truncate(time.Minute)
			offsets := []time.Duration{0, 30 * time.Second, time.Minute - time.Millisecond, time.Minute, time.Minute + 30*time.Second, 2 * time.Minute}
			type row struct {
				id   string
				at   time.Time
				hash [32]byte
			}
			var rows []row
			for i, off := range offsets {
				// A payload whose hash starts with a byte >= 0x80 (negative big-endian integer)
				// for every other row.
				var h [32]byte
				for n := 0; ; n++ {
					h = sha256.Sum256([]byte(fmt.Sprintf("p-%d-%d", i, n)))
					if (h[0] >= 0x80) == (i%2 == 0) {
						break
					}
				}
				r := row{id: uuid7(fmt.Sprintf("v1-%d", i), now), at: minute.Add(off), hash: h}
				rows = append(rows, r)
				v1.insert(t, r.id, h, "$4", r.at)
			}
			// Over a first-version compact table: 0003 and every migration after it.
			if applied, err := s.Migrate(ctx); err != nil || len(applied) == 0 || applied[0] != 3 || len(applied) != latestMigration(t, s)-2 {
				t.Fatalf("migrate: %v %v", applied, err)
			}
			for i, r := range rows {
				d := plain(r.id, "billing")
				d.PayloadHash, d.ProducerTime = r.hash[:], now
				mustClaim(t, s, d, contract.Duplicate)
				var stored int16
				if err := sch.Pool.QueryRow(ctx, "SELECT payload_hash FROM "+s.Table()+" WHERE message_id = $1::uuid", r.id).Scan(&stored); err != nil {
					t.Fatal(err)
				}
				if got := binary.BigEndian.AppendUint16(nil, uint16(stored)); string(got) != string(r.hash[:2]) {
					t.Errorf("row %d: stored hash %x, want %x", i, got, r.hash[:2])
				}
				other := rows[(i+1)%len(rows)].hash
				if string(other[:2]) != string(r.hash[:2]) {
					d.PayloadHash = other[:]
					mustClaim(t, s, d, contract.Collision) // another payload is told apart
				}
			}
			left := func() map[string]bool {
				got := map[string]bool{}
				rs, err := sch.Pool.Query(ctx, "SELECT message_id::text FROM "+s.Table())
				if err != nil {
					t.Fatal(err)
				}
				for rs.Next() {
					var id string
					if err := rs.Scan(&id); err != nil {
						t.Fatal(err)
					}
					got[id] = true
				}
				return got
			}
			for _, before := range []time.Time{minute.Add(59 * time.Second), minute.Add(time.Minute), minute.Add(time.Minute + 45*time.Second), minute.Add(2 * time.Minute)} {
				if _, err := s.Purge(ctx, pgstore.PurgeParams{Before: before}); err != nil {
					t.Fatal(err)
				}
				got := left()
				for i, r := range rows {
					if !r.at.Before(before) && !got[r.id] {
						t.Errorf("purge before %s deleted row %d received at %s: early", before.Format(time.TimeOnly), i, r.at.Format("15:04:05.000"))
					}
					if r.at.Before(before.Truncate(time.Minute)) && got[r.id] {
						t.Errorf("purge before %s kept row %d received at %s, a whole minute earlier", before.Format(time.TimeOnly), i, r.at.Format("15:04:05.000"))
					}
				}
			}
		})
	}
}

// TestConcurrentBatchesShareAKey: on every layout, a plain and a counted batch claim of keys
// [b, c] while a batch of [a, b] is open: it does not wait (the key's lock is tried), decides
// b RunAlone and claims c; once the first commits, b claimed alone with the first batch's
// payload is a duplicate and with another payload a collision (the first batch's stored hash:
// its first 2 bytes in the compact layout, whose first byte is >= 0x80 here).
func TestConcurrentBatchesShareAKey(t *testing.T) {
	hashOf := func(s string) []byte {
		for n := 0; ; n++ {
			h := sha256.Sum256([]byte(fmt.Sprintf("%s-%d", s, n)))
			if h[0] >= 0x80 {
				return h[:]
			}
		}
	}
	for _, l := range everyLayout {
		for _, counted := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/counted=%v", l.name, counted), func(t *testing.T) {
				s, sch := layoutStore(t, 4, l.cfg)
				keys := newLayoutKeys(s.Config())
				ctx := context.Background()
				claim := func(name, payload string) contract.Delivery {
					c := keys.claim(name)
					c.PayloadHash = hashOf(payload)
					if !counted {
						c.MaxAttempts, c.CountFirst = 0, false
					}
					return c
				}
				decisions := func(ds []contract.Delivery, cs []contract.Claim, want map[string]contract.Decision) {
					t.Helper()
					for k, d := range ds {
						for name, w := range want {
							if d.Key.MessageID == keys.id(name) && cs[k].Decision != w {
								t.Fatalf("member %s: %s, want %s", name, decisionName(cs[k].Decision), decisionName(w))
							}
						}
					}
				}
				ds1 := sortedByKey(claim("a", "pa"), claim("b", "pb"))
				first, cs, err := s.ClaimBatch(ctx, ds1)
				if err != nil {
					t.Fatalf("first batch: %v", err)
				}
				decisions(ds1, cs, map[string]contract.Decision{"a": contract.Run, "b": contract.Run})
				ds2 := sortedByKey(claim("b", "pb-other"), claim("c", "pc"))
				cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				start := time.Now()
				second, cs, err := s.ClaimBatch(cctx, ds2)
				cancel()
				if err != nil {
					t.Fatalf("second batch: %v", err)
				}
				if d := time.Since(start); d > 3*time.Second {
					t.Fatalf("the second batch took %s: it waited for the first", d)
				}
				decisions(ds2, cs, map[string]contract.Decision{"b": contract.RunAlone, "c": contract.Run})
				if err := first.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				if err := second.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				mustClaim(t, s, claim("b", "pb"), contract.Duplicate)
				mustClaim(t, s, claim("b", "pb-other"), contract.Collision)
				rows, records := rowsAndRecords(t, sch.Pool, s)
				if rows != 3 || records != 0 {
					t.Fatalf("%d inbox rows and %d attempt records, want 3 and 0", rows, records)
				}
			})
		}
	}
}

// TestRoleDefaultLockTimeout: a role whose default lock_timeout is 3s (ALTER ROLE ...
// SET lock_timeout) claims on the text and compact layouts by every path: its handlers run
// under 3s, and its pooled connection keeps 3s afterwards. The role is the test's own and is
// dropped at the end.
func TestRoleDefaultLockTimeout(t *testing.T) {
	ctx := context.Background()
	for _, l := range everyLayout[:2] {
		t.Run(l.name, func(t *testing.T) {
			migrated, sch := layoutStore(t, 2, l.cfg)
			role := "lock_timeout_role_" + sch.Name
			ident := pgx.Identifier{role}.Sanitize()
			schema := pgx.Identifier{sch.Name}.Sanitize()
			sch.Exec(t, "CREATE ROLE "+ident+" LOGIN")
			t.Cleanup(func() {
				c, err := pgx.Connect(ctx, testenv.DatabaseURL())
				if err != nil {
					t.Errorf("drop role: %v", err)
					return
				}
				defer c.Close(ctx)
				for _, q := range []string{"DROP OWNED BY " + ident, "DROP ROLE " + ident} {
					if _, err := c.Exec(ctx, q); err != nil {
						t.Errorf("%s: %v", q, err)
					}
				}
			})
			sch.Exec(t, "ALTER ROLE "+ident+" SET lock_timeout = '3s'")
			sch.Exec(t, "GRANT USAGE ON SCHEMA "+schema+" TO "+ident)
			sch.Exec(t, "GRANT ALL ON ALL TABLES IN SCHEMA "+schema+" TO "+ident)
			sch.Exec(t, "GRANT ALL ON ALL SEQUENCES IN SCHEMA "+schema+" TO "+ident)
			u, err := url.Parse(sch.URL)
			if err != nil {
				t.Fatal(err)
			}
			u.User = url.User(role)
			pool := testenv.NewPool(t, u.String(), 1)
			s, err := pgstore.New(pool, migrated.Config())
			if err != nil {
				t.Fatal(err)
			}
			keys := newLayoutKeys(s.Config())
			for _, path := range claimPaths {
				p := keys.claim("role-" + path.name)
				p.PayloadHash = make([]byte, 32)
				tx, claimed, err := path.claim(ctx, s, p)
				if err != nil || !claimed {
					t.Fatalf("%s: claim as the role: %v %v", path.name, err, claimed)
				}
				var lt string
				if err := handlerTx(t, tx).QueryRow(ctx, "SELECT current_setting('lock_timeout')").Scan(&lt); err != nil {
					t.Fatal(err)
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				after, _, _ := connSettings(t, pool)
				if lt != "3s" || after != "3s" {
					t.Errorf("%s: the handler ran under lock_timeout %q and the connection has %q afterwards; want the role's 3s", path.name, lt, after)
				}
				if n := claimRows(t, sch.Pool, s, p.Key.MessageID); n != 1 {
					t.Errorf("%s: %d rows of the claim, want 1", path.name, n)
				}
			}
		})
	}
}
