package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
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

// claim is the claim of name for consumer "c" (counting first).
func (k layoutKeys) claim(name string) inbox.CountedClaimParams {
	return inbox.CountedClaimParams{ClaimParams: inbox.ClaimParams{Key: inbox.Key{MessageID: k.id(name), ConsumerName: "c"}, ProducerTime: k.at}, CountFirst: true}
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

// TestBatchClaimLockTimeoutReleasesTheLocksItTook: a counted batch claim whose lock statement
// fails part-way (LockTimeout, SQLSTATE 55P03, on the second key, held by a delivery in
// flight) has already taken the first key's session lock, which a rollback does not release:
// the connection must go back to the pool holding no advisory lock, and nothing is counted;
// in every layout.
func TestBatchClaimLockTimeoutReleasesTheLocksItTook(t *testing.T) {
	for _, l := range everyLayout {
		t.Run(l.name, func(t *testing.T) {
			s, sch := layoutStoreWith(t, 2, l.cfg, func(c *pgstore.Config) { c.LockTimeout = 150 * time.Millisecond })
			k := newLayoutKeys(l.cfg)
			ctx := context.Background()
			// "m-b" is held: a counted delivery in flight holds its session lock.
			held, _, err := s.ClaimCounted(ctx, k.claim("m-b"))
			if err != nil || held == nil {
				t.Fatalf("claim m-b: %v", err)
			}
			defer held.Rollback(ctx)
			claims := []inbox.CountedClaimParams{k.claim("m-a"), k.claim("m-b")}
			tx, _, err := s.ClaimBatch(ctx, inbox.BatchClaimParams{Claims: claims, Counted: true})
			if err == nil {
				_ = tx.Rollback(ctx)
				t.Fatal("a batch claim behind a held key did not time out")
			}
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != pgstore.SQLStateLockNotAvailable {
				t.Fatalf("batch claim: %v, want SQLSTATE 55P03", err)
			}
			// The pool's other connection is the one the batch used.
			var locks int
			if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()").Scan(&locks); err != nil {
				t.Fatal(err)
			}
			if locks != 0 {
				t.Fatalf("the failed batch claim's connection went back to the pool holding %d advisory locks", locks)
			}
			var rows int
			if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+s.AttemptsTable()+" WHERE message_id = $1", k.id("m-a")).Scan(&rows); err != nil || rows != 0 {
				t.Fatalf("attempt rows of m-a = %d (%v), want 0: the batch never claimed it", rows, err)
			}
		})
	}
}

// TestCountedCommitClearsAndUnlocksInEveryLayout: a counted delivery that counted first, whose
// key has an earlier failed attempt, commits: the clean-up statement that also releases the
// key's session lock (its $3 the period when partitioned) deletes the attempt record and the
// connection goes back to the pool holding no advisory lock, in every layout.
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
			p := inbox.CountedClaimParams{ClaimParams: inbox.ClaimParams{Key: inbox.Key{MessageID: uuid7(name, at), ConsumerName: "c"}, PayloadHash: make([]byte, 32), ProducerTime: at}, CountFirst: true}
			tx, res, err := s.ClaimCounted(ctx, p)
			if err != nil || !res.Claimed {
				t.Fatalf("first claim: %v %+v", err, res)
			}
			if _, err := tx.Fail(ctx, inbox.FailParams{Error: "boom"}); err != nil {
				t.Fatal(err)
			}
			tx, res, err = s.ClaimCounted(ctx, p)
			if err != nil || !res.Claimed || res.Record.Attempts != 2 {
				t.Fatalf("second claim: %v %+v, want claimed with 2 attempts", err, res)
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
// claimed by an uncommitted transaction gives its connection back while it waits (the
// default's tried key locks, or a positive ClaimLockTimeout, as a single claim does), then,
// once the first commits, claims the other key and finds the duplicate; counted and
// uncounted, in every layout.
func TestBatchClaimBehindAClaimInFlightHoldsNoConnection(t *testing.T) {
	for _, mode := range []struct {
		name    string
		timeout time.Duration
	}{{"tried-lock", 0}, {"lock-timeout", pgstore.DefaultClaimLockTimeout}} {
		for _, counted := range []bool{true, false} {
			for _, l := range everyLayout {
				t.Run(fmt.Sprintf("%s/counted=%v/%s", mode.name, counted, l.name), func(t *testing.T) {
					testBatchBehindAClaimInFlight(t, l.cfg, mode.timeout, counted)
				})
			}
		}
	}
}

func testBatchBehindAClaimInFlight(t *testing.T, cfg pgstore.Config, claimLockTimeout time.Duration, counted bool) {
	s, sch := layoutStoreWith(t, 2, cfg, func(c *pgstore.Config) { c.ClaimLockTimeout = claimLockTimeout })
	k := newLayoutKeys(cfg)
	ctx := context.Background()
	first, res, err := s.Claim(ctx, k.claim("m-b").ClaimParams)
	if err != nil || !res.Claimed {
		t.Fatalf("first claim: %v %+v", err, res)
	}
	type result struct {
		res []inbox.CountedClaimResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		claims := []inbox.CountedClaimParams{k.claim("m-a"), k.claim("m-b")}
		cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		tx, r, err := s.ClaimBatch(cctx, inbox.BatchClaimParams{Claims: claims, Counted: counted})
		if err == nil {
			err = tx.Commit(ctx)
		}
		done <- result{r, err}
	}()
	free := freeConnectionProbes(sch.Pool)
	select {
	case r := <-done:
		t.Fatalf("the batch claim returned while a key was in flight: %v %+v; want it to wait", r.err, r.res)
	default:
	}
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var r result
	select {
	case r = <-done:
	case <-time.After(25 * time.Second):
		t.Fatal("the batch claim did not return after the first committed")
	}
	if free < 10 {
		t.Fatalf("the waiting batch claim held its connection: the pool's second connection was free %d times of 20", free)
	}
	if r.err != nil || len(r.res) != 2 || !r.res[0].Claimed || r.res[1].Claimed {
		t.Fatalf("batch claim after the first committed: %v %+v, want m-a claimed and m-b a duplicate", r.err, r.res)
	}
	rows, records := rowsAndRecords(t, sch.Pool, s)
	if rows != 2 || records != 0 {
		t.Fatalf("%d processed rows, %d attempt records; want 2, 0 (a wait is not an attempt)", rows, records)
	}
}

// TestBatchClaimWaitingForAConnectionSaysSo: with every pool connection in use, a batch
// claim whose context ends fails with ErrWaitingForConnection, as a single claim does, and
// claims and counts nothing; in every layout (the compact layout's first claim of a consumer
// registers its name, which waits for the connection the same way).
func TestBatchClaimWaitingForAConnectionSaysSo(t *testing.T) {
	for _, l := range everyLayout {
		t.Run(l.name, func(t *testing.T) {
			s, sch := layoutStoreWith(t, 1, l.cfg, func(c *pgstore.Config) { c.ClaimLockTimeout = pgstore.DefaultClaimLockTimeout })
			k := newLayoutKeys(l.cfg)
			conn, err := sch.Pool.Acquire(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			defer cancel()
			claims := []inbox.CountedClaimParams{k.claim("m-a"), k.claim("m-b")}
			_, _, err = s.ClaimBatch(ctx, inbox.BatchClaimParams{Claims: claims, Counted: true})
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
