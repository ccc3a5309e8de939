package pgstore_test

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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
			if applied, err := s.Migrate(ctx); err != nil || len(applied) != 1 {
				t.Fatalf("migrate: %v %v", applied, err)
			}
			for i, r := range rows {
				tx, res, err := s.Claim(ctx, inbox.ClaimParams{Key: inbox.Key{MessageID: r.id, ConsumerName: "billing"}, PayloadHash: r.hash[:], ProducerTime: now})
				if err != nil || res.Claimed || tx != nil {
					t.Fatalf("row %d after 0003: %v %+v, want a duplicate", i, err, res)
				}
				if string(res.StoredPayloadHash) != string(r.hash[:2]) {
					t.Errorf("row %d: stored hash %x, want %x", i, res.StoredPayloadHash, r.hash[:2])
				}
				other := rows[(i+1)%len(rows)].hash
				if string(other[:2]) != string(r.hash[:2]) && strings.HasPrefix(string(other[:]), string(res.StoredPayloadHash)) {
					t.Errorf("row %d: another payload is not told apart", i)
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
				if _, err := s.Purge(ctx, inbox.PurgeParams{Before: before}); err != nil {
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

// TestConcurrentBatchesShareAKey: on every layout, a plain and a counted batch claim
// of keys [b, c] behind an open batch of [a, b]: it waits (in process) until the first
// commits, then claims c and reports b as a duplicate with the first batch's stored hash
// (its first 2 bytes in the compact layout, whose first byte is >= 0x80 here), so that the
// same payload is a duplicate and another payload a collision.
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
				claim := func(name, payload string) inbox.CountedClaimParams {
					c := keys.claim(name)
					c.PayloadHash = hashOf(payload)
					c.CountFirst = counted
					return c
				}
				first, res, err := s.ClaimBatch(ctx, inbox.BatchClaimParams{Claims: []inbox.CountedClaimParams{claim("a", "pa"), claim("b", "pb")}, Counted: counted})
				if err != nil || !res[0].Claimed || !res[1].Claimed {
					t.Fatalf("first batch: %v %+v", err, res)
				}
				type out struct {
					res []inbox.CountedClaimResult
					err error
					bt  inbox.BatchTx
				}
				done := make(chan out, 1)
				go func() {
					cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
					defer cancel()
					bt, res, err := s.ClaimBatch(cctx, inbox.BatchClaimParams{Claims: []inbox.CountedClaimParams{claim("b", "pb-other"), claim("c", "pc")}, Counted: counted})
					done <- out{res, err, bt}
				}()
				time.Sleep(150 * time.Millisecond)
				select {
				case o := <-done:
					t.Fatalf("the second batch did not wait for the first: %+v %v", o.res, o.err)
				default:
				}
				if err := first.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				o := <-done
				if o.err != nil {
					t.Fatalf("second batch: %v", o.err)
				}
				if o.res[0].Claimed || !o.res[1].Claimed {
					t.Fatalf("second batch: b claimed %v, c claimed %v; want a duplicate and a claim", o.res[0].Claimed, o.res[1].Claimed)
				}
				stored := o.res[0].StoredPayloadHash
				if len(stored) == 0 || !strings.HasPrefix(string(hashOf("pb")), string(stored)) || strings.HasPrefix(string(hashOf("pb-other")), string(stored)) {
					t.Fatalf("b's stored hash %x: not a prefix of the first payload's %x, or also of the other's %x", stored, hashOf("pb")[:4], hashOf("pb-other")[:4])
				}
				if err := o.bt.Commit(ctx); err != nil {
					t.Fatal(err)
				}
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
				p := keys.claim("role-" + path.name).ClaimParams
				p.PayloadHash = make([]byte, 32)
				tx, claimed, err := path.claim(ctx, s, p)
				if err != nil || !claimed {
					t.Fatalf("%s: claim as the role: %v %v", path.name, err, claimed)
				}
				ptx, _ := pgstore.PgxTx(tx)
				var lt string
				if err := ptx.QueryRow(ctx, "SELECT current_setting('lock_timeout')").Scan(&lt); err != nil {
					t.Fatal(err)
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				after, _, _ := connSettings(t, pool)
				if lt != "3s" || after != "3s" {
					t.Errorf("%s: the handler ran under lock_timeout %q and the connection has %q afterwards; want the role's 3s", path.name, lt, after)
				}
			}
		})
	}
}
