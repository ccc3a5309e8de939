package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// everyLayout is each layout and mode a store can have, by name.
var everyLayout = []struct {
	name string
	cfg  pgstore.Config
}{
	{"text", pgstore.Config{}},
	{"compact", pgstore.Config{Layout: pgstore.LayoutCompact}},
	{"partitioned", pgstore.Config{Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}}},
	{"compact-partitioned", pgstore.Config{Layout: pgstore.LayoutCompact, Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromClaim, Interval: pgstore.PartitionHourly}}},
}

// layoutKeys names a test's message IDs in a layout: the text layout takes names as they
// are; the others get a UUIDv7 at a fixed time derived from the name, and the claims carry
// that time as their producer time.
type layoutKeys struct {
	text bool
	at   time.Time
}

func newLayoutKeys(cfg pgstore.Config) layoutKeys {
	return layoutKeys{text: cfg.Layout == pgstore.LayoutText && cfg.Partitioning == nil, at: time.Now().UTC().Truncate(time.Millisecond)}
}

func (k layoutKeys) id(name string) string {
	if k.text {
		return name
	}
	return uuid7(name, k.at)
}

// claim is the delivery of name for consumer "c", counted first (MaxAttempts 3).
func (k layoutKeys) claim(name string) contract.Delivery {
	d := countedFirst(plain(k.id(name), "c"), true)
	d.ProducerTime = k.at
	return d
}

// layoutStoreWith returns a store of cfg with the settings of with on a table that layoutStore
// migrated.
func layoutStoreWith(t *testing.T, conns int32, cfg pgstore.Config, with func(*pgstore.Config)) (*pgstore.Store, *testenv.Schema) {
	t.Helper()
	migrated, sch := layoutStore(t, conns, cfg)
	cfg = migrated.Config()
	with(&cfg)
	s, err := pgstore.New(sch.Pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s, sch
}

// TestBatchWithAHeldKeyTakesNoLockAway: a counted batch claim one of whose keys ("m-b") is
// held by a delivery in flight decides that member RunAlone at once (the key's lock is tried,
// never waited for), runs the other, and, once rolled back, leaves no pooled connection
// holding an advisory lock and no count of either key but the holder's; in every layout.
func TestBatchWithAHeldKeyTakesNoLockAway(t *testing.T) {
	for _, l := range everyLayout {
		t.Run(l.name, func(t *testing.T) {
			s, sch := layoutStoreWith(t, 3, l.cfg, func(c *pgstore.Config) { c.LockTimeout = 150 * time.Millisecond })
			k := newLayoutKeys(l.cfg)
			ctx := context.Background()
			held, _ := mustClaim(t, s, k.claim("m-b"), contract.Run) // counted: 1 attempt of m-b
			defer release(held)
			ds := sortedByKey(k.claim("m-a"), k.claim("m-b"))
			start := time.Now()
			bt, cs, err := s.ClaimBatch(ctx, ds)
			if err != nil {
				t.Fatalf("batch claim: %v", err)
			}
			if d := time.Since(start); d > 3*time.Second {
				t.Fatalf("the batch claim took %s behind a held key", d)
			}
			for i, d := range ds {
				want := contract.Run
				if d.Key.MessageID == k.id("m-b") {
					want = contract.RunAlone
				}
				if cs[i].Decision != want {
					t.Fatalf("member %d: %s, want %s", i, decisionName(cs[i].Decision), decisionName(want))
				}
			}
			if n, _ := attemptsRow(t, sch.Pool, s, k.claim("m-a").Key); n != 1 {
				t.Fatalf("m-a counted %d times in the batch, want once", n)
			}
			if err := bt.Rollback(ctx); err != nil {
				t.Fatal(err)
			}
			for _, c := range sch.Pool.AcquireAllIdle(ctx) {
				locks := advisoryLocks(t, c)
				c.Release()
				if locks != 0 {
					t.Fatalf("a pooled connection holds %d advisory locks after the batch", locks)
				}
			}
			if n, ok := attemptsRow(t, sch.Pool, s, k.claim("m-a").Key); ok {
				t.Fatalf("m-a has %d attempts after the rollback, want no record (taken back)", n)
			}
			if n, _ := attemptsRow(t, sch.Pool, s, k.claim("m-b").Key); n != 1 {
				t.Fatalf("m-b has %d attempts, want the holder's 1 only", n)
			}
			if rows := claimRows(t, sch.Pool, s, k.id("m-a")); rows != 0 {
				t.Fatalf("%d rows of m-a after the rollback", rows)
			}
		})
	}
}

// TestBatchRollbackTakesItsCountsBackWithThePoolInUse: a batch whose members counted first is
// rolled back while every other pool connection is in use (a pool of 2, the other held by a
// delivery in flight): the counts are taken back all the same, and at once (the batch's own
// connection is free after its ROLLBACK), not left as an attempt the members never made;
// Rollback, and a Commit refused because the handler ended the transaction.
func TestBatchRollbackTakesItsCountsBackWithThePoolInUse(t *testing.T) {
	for _, end := range []string{"Rollback", "refused Commit"} {
		t.Run(end, func(t *testing.T) {
			s, sch := layoutStore(t, 2, pgstore.Config{})
			ctx := context.Background()
			held, _ := mustClaim(t, s, plain("m-other", "c"), contract.Run)
			defer release(held)
			ds := []contract.Delivery{countedFirst(plain("m-a", "c"), true), countedFirst(plain("m-b", "c"), true)}
			bt, _, err := s.ClaimBatch(ctx, ds)
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			if end == "Rollback" {
				err = bt.Rollback(ctx)
			} else {
				_ = handlerTx(t, bt).Rollback(ctx)
				if err = bt.Commit(ctx); errors.Is(err, contract.ErrTxEnded) {
					err = nil
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			took := time.Since(start)
			side := sideConn(t, sch.URL)
			for _, d := range ds {
				if n, ok := attemptsRow(t, side, s, d.Key); ok {
					t.Errorf("%s has %d attempts after the batch's %s (%s), want no record: its count was not taken back", d.Key.MessageID, n, end, took.Round(time.Millisecond))
				}
			}
			if took > 2*time.Second {
				t.Errorf("the batch's %s took %s with the pool in use", end, took.Round(time.Millisecond))
			}
		})
	}
}

// sortedByKey returns ds sorted by message ID, as the inbox hands a batch to the store.
func sortedByKey(ds ...contract.Delivery) []contract.Delivery {
	slices.SortFunc(ds, func(a, b contract.Delivery) int { return strings.Compare(a.Key.MessageID, b.Key.MessageID) })
	return ds
}

// TestCountedCommitClearsAndUnlocksInEveryLayout: a delivery that counted first, whose key has
// an earlier failed attempt, commits: the clean-up statement after COMMIT (its period
// parameter when partitioned) deletes the attempt record and the connection goes back to the
// pool holding no advisory lock, in every layout.
func TestCountedCommitClearsAndUnlocksInEveryLayout(t *testing.T) {
	at := time.Now().UTC()
	for name, cfg := range map[string]pgstore.Config{
		"text":        {},
		"compact":     {Layout: pgstore.LayoutCompact},
		"partitioned": {Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}},
		"both":        {Layout: pgstore.LayoutCompact, Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey, Interval: pgstore.PartitionHourly}},
	} {
		t.Run(name, func(t *testing.T) {
			s, sch := layoutStore(t, 1, cfg)
			ctx := context.Background()
			p := countedFirst(contract.Delivery{Key: contract.Key{MessageID: uuid7(name, at), ConsumerName: "c"}, PayloadHash: make([]byte, 32), ProducerTime: at}, true)
			tx, _ := mustClaim(t, s, p, contract.Run)
			if n, err := tx.Fail(ctx, contract.Failure{Counts: true, Error: "boom"}); err != nil || n != 1 {
				t.Fatalf("fail: %d %v, want 1 attempt", n, err)
			}
			tx, c := mustClaim(t, s, p, contract.Run)
			if c.Attempts != 1 || c.LastError != "boom" {
				t.Fatalf("second claim: %+v, want 1 earlier attempt and its error", c)
			}
			if n, _ := attemptsRow(t, sideConn(t, sch.URL), s, p.Key); n != 2 { // the pool's one connection is the claim's
				t.Fatalf("%d attempts while the second delivery runs, want 2 (counted first)", n)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			var locks, records, rows int
			if err := sch.Pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()),"+
				" (SELECT count(*) FROM "+s.AttemptsTable()+"), (SELECT count(*) FROM "+s.Table()+")").Scan(&locks, &records, &rows); err != nil {
				t.Fatal(err)
			}
			if locks != 0 || records != 0 || rows != 1 {
				t.Fatalf("after the commit: %d advisory locks, %d attempt records, %d processed rows; want 0, 0, 1", locks, records, rows)
			}
		})
	}
}

// TestBatchClaimBehindAClaimInFlightHoldsNoConnection: a batch claim one of whose keys is
// claimed by an uncommitted transaction does not wait for it (the key's lock is tried): that
// member is decided RunAlone (the inbox claims it alone, where the claim waits in process)
// and the others run; once the first commits, the key alone is a duplicate; counted and
// uncounted, in every layout.
func TestBatchClaimBehindAClaimInFlightHoldsNoConnection(t *testing.T) {
	for _, counted := range []bool{true, false} {
		for _, l := range everyLayout {
			t.Run(fmt.Sprintf("counted=%v/%s", counted, l.name), func(t *testing.T) {
				testBatchBehindAClaimInFlight(t, l.cfg, counted)
			})
		}
	}
}

func testBatchBehindAClaimInFlight(t *testing.T, cfg pgstore.Config, counted bool) {
	s, sch := layoutStore(t, 2, cfg)
	k := newLayoutKeys(cfg)
	ctx := context.Background()
	form := func(name string) contract.Delivery {
		d := k.claim(name)
		if !counted {
			d.MaxAttempts, d.CountFirst = 0, false
		}
		return d
	}
	first, _ := mustClaim(t, s, form("m-b"), contract.Run)
	ds := sortedByKey(form("m-a"), form("m-b"))
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	start := time.Now()
	bt, cs, err := s.ClaimBatch(cctx, ds)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("the batch claim took %s behind a key in flight; want it decided at once", d)
	}
	for i, d := range ds {
		want := contract.Run
		if d.Key.MessageID == k.id("m-b") {
			want = contract.RunAlone
		}
		if cs[i].Decision != want {
			t.Fatalf("member %d: %s, want %s", i, decisionName(cs[i].Decision), decisionName(want))
		}
	}
	if err := bt.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, s, form("m-b"), contract.Duplicate)
	rows, records := rowsAndRecords(t, sch.Pool, s)
	if rows != 2 || records != 0 {
		t.Fatalf("%d processed rows, %d attempt records; want 2, 0", rows, records)
	}
}

// TestBatchClaimWaitingForAConnectionSaysSo: with every pool connection in use, a batch
// claim whose context ends fails with ErrWaitingForConnection, as a single claim does, and
// claims and counts nothing; in every layout (the compact layout's first claim of a consumer
// registers its name, which waits for the connection the same way).
func TestBatchClaimWaitingForAConnectionSaysSo(t *testing.T) {
	for _, l := range everyLayout {
		t.Run(l.name, func(t *testing.T) {
			s, sch := layoutStore(t, 1, l.cfg)
			k := newLayoutKeys(l.cfg)
			conn, err := sch.Pool.Acquire(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			_, _, err = s.ClaimBatch(ctx, sortedByKey(k.claim("m-a"), k.claim("m-b")))
			conn.Release()
			if !errors.Is(err, pgstore.ErrWaitingForConnection) || !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("batch claim with the pool exhausted: %v, want ErrWaitingForConnection and the deadline", err)
			}
			rows, records := rowsAndRecords(t, sch.Pool, s)
			if rows != 0 || records != 0 {
				t.Fatalf("%d inbox rows, %d attempt records; want none", rows, records)
			}
		})
	}
}
