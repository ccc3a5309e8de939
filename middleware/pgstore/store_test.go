package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

func newStore(t *testing.T, conns int32) (*pgstore.Store, *testenv.Schema) {
	t.Helper()
	sch := testenv.NewSchema(t, conns)
	return sch.Store(t), sch
}

// readRecord is the conformance suite's Record: the key's row in the attempts table of s (a
// *pgstore.Store, or a uuidKeys over one, whose keys it maps, under a tracked).
func readRecord(t *testing.T, s contract.Store, k contract.Key) (int, bool) {
	t.Helper()
	if tr, ok := s.(*tracked); ok {
		s = tr.Store
	}
	switch v := s.(type) {
	case *pgstore.Store:
		return attemptsRow(t, v.Pool(), v, k)
	case uuidKeys:
		return attemptsRow(t, v.Store.Pool(), v.Store, v.key(k))
	}
	t.Fatalf("readRecord: a %T", s)
	return 0, false
}

// tracked is a store under the conformance suite that ends, when the test ends, every
// transaction the suite left open (some cases end with a claim decided Run and go no
// further): each holds a pool connection, which the schema's pool would wait for when it
// closes.
type tracked struct {
	contract.Store
	mu   sync.Mutex
	open []func()
}

func track(t *testing.T, s contract.Store) *tracked {
	tr := &tracked{Store: s}
	t.Cleanup(func() { // before the pool closes (cleanups run last first)
		tr.mu.Lock()
		defer tr.mu.Unlock()
		for _, end := range tr.open {
			end()
		}
	})
	return tr
}

func (tr *tracked) Claim(ctx context.Context, d contract.Delivery) (contract.Tx, contract.Claim, error) {
	tx, c, err := tr.Store.Claim(ctx, d)
	if tx != nil {
		tr.mu.Lock()
		tr.open = append(tr.open, func() { release(tx) })
		tr.mu.Unlock()
	}
	return tx, c, err
}

func (tr *tracked) ClaimBatch(ctx context.Context, ds []contract.Delivery) (contract.BatchTx, []contract.Claim, error) {
	bt, cs, err := tr.Store.ClaimBatch(ctx, ds)
	if bt != nil {
		tr.mu.Lock()
		tr.open = append(tr.open, func() { _ = bt.Rollback(context.Background()) })
		tr.mu.Unlock()
	}
	return bt, cs, err
}

func TestConformance(t *testing.T) {
	storetest.Run(t, storetest.Harness{
		New: func(t *testing.T) contract.Store {
			s, _ := newStore(t, 6)
			return track(t, s)
		},
		Record: readRecord,
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
	d := plain("m-meta", "billing")
	d.MessageType, d.CorrelationID, d.PayloadHash = "PaymentReceived", "corr-9", hash
	mustCommit(t, s, d)
	bare := plain("m-bare", "billing")
	bare.PayloadHash = nil
	mustCommit(t, s, bare)
	var typ, corr *string
	var gotHash []byte
	var age time.Duration
	err := sch.Pool.QueryRow(ctx, `SELECT message_type, correlation_id, payload_hash, now() - received_at
		FROM inbox_processed_messages WHERE message_id = 'm-meta' AND consumer_name = 'billing'`).Scan(&typ, &corr, &gotHash, &age)
	if err != nil {
		t.Fatal(err)
	}
	if typ == nil || *typ != "PaymentReceived" || corr == nil || *corr != "corr-9" || string(gotHash) != string(hash) || age < 0 || age > time.Minute {
		t.Fatalf("row = (%v, %v, %x, age %v)", typ, corr, gotHash, age)
	}
	err = sch.Pool.QueryRow(ctx, `SELECT message_type, correlation_id, payload_hash FROM inbox_processed_messages WHERE message_id = 'm-bare'`).Scan(&typ, &corr, &gotHash)
	if err != nil || typ != nil || corr != nil || gotHash != nil {
		t.Fatalf("empty metadata must be stored as NULL: type=%v corr=%v hash=%x err=%v", typ, corr, gotHash, err)
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
	tx, _ := mustClaim(t, s, plain("m-tx", "c"), contract.Run)
	if _, err := handlerTx(t, tx).Exec(ctx, "INSERT INTO effects VALUES ('m-tx')"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Fail(ctx, contract.Failure{Counts: true, Error: "boom"}); err != nil {
		t.Fatal(err)
	}
	var effects, claims int
	_ = sch.Pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM effects), (SELECT count(*) FROM inbox_processed_messages)").Scan(&effects, &claims)
	if effects != 0 || claims != 0 {
		t.Fatalf("after Fail: effects=%d claims=%d, want 0 and 0 (business write and claim share one transaction)", effects, claims)
	}
	tx, _ = mustClaim(t, s, plain("m-tx", "c"), contract.Run)
	if _, err := handlerTx(t, tx).Exec(ctx, "INSERT INTO effects VALUES ('m-tx')"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	_ = sch.Pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM effects), (SELECT count(*) FROM inbox_processed_messages)").Scan(&effects, &claims)
	if effects != 1 || claims != 1 {
		t.Fatalf("after Commit: effects=%d claims=%d, want 1 and 1", effects, claims)
	}
}

// TestLockTimeoutEndsTheWait: a claim never waits on the server for its key; it waits in
// process, and Config.LockTimeout bounds that wait as it bounds a lock wait on the server: a
// concurrent copy behind an uncommitted claim fails with ErrClaimInFlight past LockTimeout,
// before its context's deadline, plain and counted (first or not) alike, and the error is not
// Retryable (an in-process retry would hold the connection again). Nothing is counted.
func TestLockTimeoutEndsTheWait(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	sch.Store(t) // migrated
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, LockTimeout: 150 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	d := plain("m-slow", "c")
	first, _ := mustClaim(t, s, d, contract.Run)
	defer release(first)
	for _, c := range []contract.Delivery{d, countedFirst(d, false), countedFirst(d, true)} {
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		tx, _, err := s.Claim(ctx, c)
		cancel()
		if err == nil {
			release(tx)
			t.Fatal("a claim behind an uncommitted claim did not time out")
		}
		if !errors.Is(err, pgstore.ErrClaimInFlight) || errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "LockTimeout") {
			t.Fatalf("error = %v, want ErrClaimInFlight past LockTimeout, before the context's deadline", err)
		}
		if waited := time.Since(start); waited > 2*time.Second {
			t.Fatalf("the wait took %v with a 150ms lock timeout", waited)
		}
		if cl := s.Classify(err); cl != contract.Other {
			t.Fatalf("lock timeout classified %d, want Other: %v", cl, err)
		}
	}
	var rows int
	if err := sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+s.AttemptsTable()).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("attempt rows after timed-out counted claims = %d (%v), want 0: a claim that never happened counts nothing", rows, err)
	}
	if n := claimRows(t, sch.Pool, s, "m-slow"); n != 0 {
		t.Fatalf("%d inbox rows of the uncommitted key, want 0", n)
	}
}

// TestAdvisoryLockReleasedWithTheConnection: a claim's key lock (counted first or not) is
// released when its transaction ends (commit, a failure that counts or not), so the
// connection goes back to the pool holding no lock; the rows say how each ended.
func TestAdvisoryLockReleasedWithTheConnection(t *testing.T) {
	sch := testenv.NewSchema(t, 1)
	s := sch.Store(t)
	ctx := context.Background()
	for _, first := range []bool{false, true} {
		for _, end := range []string{"commit", "fail", "fail-counts"} {
			id := fmt.Sprintf("m-lock-%s-%v", end, first)
			d := countedFirst(plain(id, "c"), first)
			tx, _ := mustClaim(t, s, d, contract.Run)
			var err error
			switch end {
			case "commit":
				err = tx.Commit(ctx)
			case "fail":
				_, err = tx.Fail(ctx, contract.Failure{})
			default:
				_, err = tx.Fail(ctx, contract.Failure{Counts: true, Error: "boom"})
			}
			if err != nil {
				t.Fatal(err)
			}
			// The pool has one connection: this query runs on the connection the claim used.
			if locks := advisoryLocks(t, sch.Pool); locks != 0 {
				t.Fatalf("after %s the connection still holds %d advisory locks", end, locks)
			}
			rows := claimRows(t, sch.Pool, s, id)
			n, ok := attemptsRow(t, sch.Pool, s, d.Key)
			switch {
			case end == "commit" && (rows != 1 || ok):
				t.Fatalf("%s: %d rows, attempt record %v (%d); want the row and no record", id, rows, ok, n)
			case end == "fail" && (rows != 0 || ok):
				t.Fatalf("%s: %d rows, attempt record %v (%d); want neither", id, rows, ok, n)
			case end == "fail-counts" && (rows != 0 || !ok || n != 1):
				t.Fatalf("%s: %d rows, attempt record %v (%d); want no row and 1 attempt", id, rows, ok, n)
			}
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
