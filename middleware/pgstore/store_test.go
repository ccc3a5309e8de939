package pgstore_test

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
)

func newStore(t *testing.T, conns int32) (*pgstore.Store, *testenv.Schema) {
	t.Helper()
	sch := testenv.NewSchema(t, conns)
	return sch.Store(t), sch
}

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) inbox.Store {
		s, _ := newStore(t, 6)
		return s
	})
}

func TestNewRejectsUnsafeIdentifiers(t *testing.T) {
	sch := testenv.NewSchema(t, 1)
	for _, cfg := range []pgstore.Config{
		{Table: `inbox"; DROP TABLE accounts; --`},
		{Schema: "public.x"},
		{Table: "1starts_with_digit"},
		{Table: strings.Repeat("a", 48)},
		{Schema: strings.Repeat("s", 64)},
		{Table: "café"},
	} {
		if _, err := pgstore.New(sch.Pool, cfg); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("New(%+v) error = %v, want ErrInvalidConfig", cfg, err)
		}
	}
	if _, err := pgstore.New(nil, pgstore.Config{}); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("New(nil pool) error = %v, want ErrInvalidConfig", err)
	}
}

func tableExists(t *testing.T, sch *testenv.Schema, schema, table string) bool {
	t.Helper()
	var ok bool
	err := sch.Pool.QueryRow(context.Background(),
		"SELECT EXISTS (SELECT 1 FROM information_schema.tables WHERE table_schema = $1 AND table_name = $2)", schema, table).Scan(&ok)
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

func TestMigrateConcurrentlyAppliesOnce(t *testing.T) {
	sch := testenv.NewSchema(t, 8)
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Table: "shared_inbox"})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	results := make([][]int, 6)
	errs := make([]error, 6)
	for i := range results {
		wg.Go(func() { results[i], errs[i] = s.Migrate(context.Background()) })
	}
	wg.Wait()
	total := 0
	for i := range results {
		if errs[i] != nil {
			t.Fatalf("concurrent Migrate %d: %v", i, errs[i])
		}
		total += len(results[i])
	}
	ms, _ := s.Migrations()
	if total != len(ms) {
		t.Fatalf("six concurrent Migrate calls applied %d migrations in total, want %d (each exactly once)", total, len(ms))
	}
	var recorded int
	if err := sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM watermill_inbox_migrations").Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if recorded != len(ms) || !tableExists(t, sch, sch.Name, "shared_inbox") {
		t.Fatalf("recorded versions = %d, table exists = %v", recorded, tableExists(t, sch, sch.Name, "shared_inbox"))
	}
	again, err := s.Migrate(context.Background())
	if err != nil || len(again) != 0 {
		t.Fatalf("Migrate on a current schema applied %v, err %v", again, err)
	}
}

func TestMigrationSQLIsAppliableAndRecorded(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name + "_own", Table: "my_inbox"})
	if err != nil {
		t.Fatal(err)
	}
	script, err := s.MigrationSQL()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(script, `"`+sch.Name+`_own"."my_inbox"`) {
		t.Fatalf("script does not use the quoted configured table:\n%s", script)
	}
	ctx := context.Background()
	// The users' own tool runs the script; the schema must exist for it.
	if _, err := sch.Pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{sch.Name + "_own"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = sch.Pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{sch.Name + "_own"}.Sanitize()+" CASCADE")
	})
	conn, err := sch.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Conn().PgConn().Exec(ctx, script).ReadAll(); err != nil {
		t.Fatalf("running the printed script: %v", err)
	}
	if !tableExists(t, sch, sch.Name+"_own", "my_inbox") {
		t.Fatal("script did not create the table")
	}
	applied, err := s.Migrate(ctx)
	if err != nil || len(applied) != 0 {
		t.Fatalf("Migrate after the printed script applied %v (err %v), want nothing", applied, err)
	}
}

func TestClaimStoresMetadata(t *testing.T) {
	s, sch := newStore(t, 2)
	ctx := context.Background()
	hash := []byte("0123456789abcdef0123456789abcdef")
	tx, claimed, err := s.Claim(ctx, inbox.ClaimParams{
		Key: inbox.Key{MessageID: "m-meta", ConsumerName: "billing"}, MessageType: "PaymentReceived", CorrelationID: "corr-9", PayloadHash: hash,
	})
	if err != nil || !claimed.Claimed {
		t.Fatalf("claim: claimed=%v err=%v", claimed, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	tx2, _, err := s.Claim(ctx, inbox.ClaimParams{Key: inbox.Key{MessageID: "m-bare", ConsumerName: "billing"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx2.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var typ, corr *string
	var gotHash []byte
	var age time.Duration
	err = sch.Pool.QueryRow(ctx, `SELECT message_type, correlation_id, payload_hash, now() - received_at
		FROM inbox_processed_messages WHERE message_id = 'm-meta' AND consumer_name = 'billing'`).Scan(&typ, &corr, &gotHash, &age)
	if err != nil {
		t.Fatal(err)
	}
	if typ == nil || *typ != "PaymentReceived" || corr == nil || *corr != "corr-9" || string(gotHash) != string(hash) || age < 0 || age > time.Minute {
		t.Fatalf("row = (%v, %v, %x, age %v)", typ, corr, gotHash, age)
	}
	err = sch.Pool.QueryRow(ctx, `SELECT message_type, correlation_id FROM inbox_processed_messages WHERE message_id = 'm-bare'`).Scan(&typ, &corr)
	if err != nil || typ != nil || corr != nil {
		t.Fatalf("empty metadata must be stored as NULL: type=%v corr=%v err=%v", typ, corr, err)
	}
}

func TestTxFromContextIsTheClaimTransaction(t *testing.T) {
	s, sch := newStore(t, 2)
	ctx := context.Background()
	if _, ok := pgstore.TxFromContext(ctx); ok {
		t.Fatal("TxFromContext found a transaction in a plain context")
	}
	if _, err := sch.Pool.Exec(ctx, "CREATE TABLE effects (id text PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	tx, _, err := s.Claim(ctx, inbox.ClaimParams{Key: inbox.Key{MessageID: "m-tx", ConsumerName: "c"}})
	if err != nil {
		t.Fatal(err)
	}
	ptx, ok := pgstore.TxFromContext(tx.Context(ctx))
	if !ok {
		t.Fatal("TxFromContext found no transaction in the claim's context")
	}
	if _, err := ptx.Exec(ctx, "INSERT INTO effects VALUES ('m-tx')"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	var effects, claims int
	_ = sch.Pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM effects), (SELECT count(*) FROM inbox_processed_messages)").Scan(&effects, &claims)
	if effects != 0 || claims != 0 {
		t.Fatalf("after rollback: effects=%d claims=%d, want 0 and 0 (business write and claim share one transaction)", effects, claims)
	}
}

// TestLockTimeoutEndsTheWait: with the claim waiting on the server (ClaimLockTimeout
// negative), Config.LockTimeout bounds a concurrent duplicate's wait behind an uncommitted
// claim (SQLSTATE 55P03), for plain and counted claims alike, and the expired wait is not
// Retryable (an in-process retry would hold the connection again). With the default tried
// lock and LockTimeout set, the claim does not wait on the server: it waits in process, and
// LockTimeout ends that wait too (ErrClaimInFlight). Either way nothing is counted.
func TestLockTimeoutEndsTheWait(t *testing.T) {
	for _, mode := range []struct {
		name  string
		claim time.Duration
	}{{"server-wait", -1}, {"tried-lock", 0}} {
		t.Run(mode.name, func(t *testing.T) {
			sch := testenv.NewSchema(t, 4)
			sch.Store(t) // migrated
			s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, LockTimeout: 150 * time.Millisecond, ClaimLockTimeout: mode.claim})
			if err != nil {
				t.Fatal(err)
			}
			p := inbox.ClaimParams{Key: inbox.Key{MessageID: "m-slow", ConsumerName: "c"}}
			first, res, err := s.Claim(context.Background(), p)
			if err != nil || !res.Claimed {
				t.Fatalf("first claim: %v %+v", err, res)
			}
			defer first.Rollback(context.Background())
			for _, countFirst := range []bool{false, true} {
				start := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), 400*time.Millisecond)
				tx, _, err := s.ClaimCounted(ctx, inbox.CountedClaimParams{ClaimParams: p, CountFirst: countFirst})
				cancel()
				if err == nil {
					_ = tx.Rollback(context.Background())
					t.Fatal("a claim behind an uncommitted claim did not time out")
				}
				var pgErr *pgconn.PgError
				if mode.claim < 0 {
					if !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
						t.Fatalf("error = %v, want SQLSTATE 55P03", err)
					}
				} else if !errors.Is(err, pgstore.ErrClaimInFlight) || errors.Is(err, context.DeadlineExceeded) {
					t.Fatalf("error = %v, want ErrClaimInFlight past LockTimeout, before the context's deadline", err)
				}
				if waited := time.Since(start); waited > 5*time.Second {
					t.Fatalf("the lock wait took %v with a 150ms lock timeout", waited)
				}
				if s.Retryable(err) {
					t.Fatalf("lock timeout reported as Retryable: %v", err)
				}
			}
			var rows int
			if err := sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+s.AttemptsTable()).Scan(&rows); err != nil || rows != 0 {
				t.Fatalf("attempt rows after timed-out counted claims = %d (%v), want 0: a claim that never happened takes its count back", rows, err)
			}
		})
	}
}

// TestAdvisoryLockReleasedWithTheConnection: a counted claim's key lock is released when its
// transaction ends, so the connection goes back to the pool holding no lock.
func TestAdvisoryLockReleasedWithTheConnection(t *testing.T) {
	sch := testenv.NewSchema(t, 1)
	s := sch.Store(t)
	ctx := context.Background()
	for _, end := range []string{"commit", "rollback", "fail"} {
		id := "m-lock-" + end
		tx, _, err := s.ClaimCounted(ctx, inbox.CountedClaimParams{ClaimParams: inbox.ClaimParams{Key: inbox.Key{MessageID: id, ConsumerName: "c"}}, CountFirst: true})
		if err != nil {
			t.Fatal(err)
		}
		switch end {
		case "commit":
			err = tx.Commit(ctx)
		case "rollback":
			err = tx.Rollback(ctx)
		default:
			_, err = tx.Fail(ctx, inbox.FailParams{Error: "boom"})
		}
		if err != nil {
			t.Fatal(err)
		}
		var locks int
		// The pool has one connection: this query runs on the connection the claim used.
		if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()").Scan(&locks); err != nil {
			t.Fatal(err)
		}
		if locks != 0 {
			t.Fatalf("after %s the connection still holds %d advisory locks", end, locks)
		}
	}
}

// TestMigrateWithoutDatabaseCreatePrivilege: an application role that may use and create in
// its schema, but not create schemas in the database, can run Migrate on an existing schema
// (PostgreSQL checks CREATE on the database for CREATE SCHEMA IF NOT EXISTS even when the
// schema exists, SQLSTATE 42501).
func TestMigrateWithoutDatabaseCreatePrivilege(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	ctx := context.Background()
	role := sch.Name + "_app"
	ident := pgx.Identifier{role}.Sanitize()
	schemaIdent := pgx.Identifier{sch.Name}.Sanitize()
	for _, q := range []string{
		"CREATE ROLE " + ident + " LOGIN",
		"GRANT USAGE, CREATE ON SCHEMA " + schemaIdent + " TO " + ident,
	} {
		if _, err := sch.Pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		_, _ = sch.Pool.Exec(context.Background(), "DROP OWNED BY "+ident)
		_, _ = sch.Pool.Exec(context.Background(), "DROP ROLE "+ident)
	})
	var canCreate bool
	if err := sch.Pool.QueryRow(ctx, "SELECT has_database_privilege($1, current_database(), 'CREATE')", role).Scan(&canCreate); err != nil || canCreate {
		t.Fatalf("the test role may create schemas (%v, %v); the test would prove nothing", canCreate, err)
	}
	u, _ := url.Parse(sch.URL)
	u.User = url.User(role)
	appPool := testenv.NewPool(t, u.String(), 1)
	s, err := pgstore.New(appPool, pgstore.Config{Schema: sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate as a role without CREATE on the database: %v", err)
	}
	if applied, err := s.Migrate(ctx); err != nil || len(applied) != 0 {
		t.Fatalf("second Migrate: %v, %v", applied, err)
	}
}

// TestMigrateRefusesATableWithOtherKeys: CREATE TABLE IF NOT EXISTS would adopt an existing
// table of the same name keyed on message_id alone (the seed's single-consumer example), on
// which every claim fails; Migrate reports it instead.
func TestMigrateRefusesATableWithOtherKeys(t *testing.T) {
	sch := testenv.NewSchema(t, 1)
	ctx := context.Background()
	if _, err := sch.Pool.Exec(ctx, "CREATE TABLE inbox_processed_messages (message_id text PRIMARY KEY, consumer_name text, received_at timestamptz NOT NULL DEFAULT now())"); err != nil {
		t.Fatal(err)
	}
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Migrate(ctx); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("Migrate over a table keyed on message_id alone: %v, want ErrInvalidConfig", err)
	}
}
