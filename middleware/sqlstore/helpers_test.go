package sqlstore_test

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/sqlstore"
)

// DefaultMySQLDSN is the MariaDB of the test machines (root, no password), used when
// INBOX_MYSQL_DSN is unset; it names no database (each test creates its own).
const DefaultMySQLDSN = "root@tcp(127.0.0.1:3306)/"

func mysqlDSN() string {
	if v := os.Getenv("INBOX_MYSQL_DSN"); v != "" {
		return v
	}
	return DefaultMySQLDSN
}

var dialects = []sqlstore.Dialect{sqlstore.PostgreSQL, sqlstore.MySQL}

// forEach runs f as a subtest per dialect.
func forEach(t *testing.T, f func(t *testing.T, d sqlstore.Dialect)) {
	for _, d := range dialects {
		t.Run(d.String(), func(t *testing.T) { f(t, d) })
	}
}

func randomName(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// env is a fresh, empty database (MySQL) or schema (PostgreSQL) for one test, with a *sql.DB
// on it and its admin DSN.
type env struct {
	dialect sqlstore.Dialect
	db      *sql.DB
	schema  string // PostgreSQL schema or MySQL database
	dsn     string // the DSN db was opened on
}

// newEnv creates a fresh database or schema, dropped when t ends, and a *sql.DB of maxConns
// connections on it. It skips t under -short and fails t (never skips) when the service is
// unreachable.
func newEnv(t testing.TB, d sqlstore.Dialect, maxConns int) *env {
	t.Helper()
	e := &env{dialect: d}
	switch d {
	case sqlstore.PostgreSQL:
		sch := testenv.NewSchema(t, 2)
		e.schema, e.dsn = sch.Name, testenv.DatabaseURL()
	case sqlstore.MySQL:
		testenv.SkipShort(t, "MariaDB")
		admin, err := sql.Open("mysql", mysqlDSN())
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := admin.PingContext(ctx); err != nil {
			_ = admin.Close()
			t.Fatalf("MariaDB is not reachable: %v\nstart it with: start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd", err)
		}
		e.schema = randomName("t_")
		if _, err := admin.Exec("CREATE DATABASE `" + e.schema + "`"); err != nil {
			t.Fatal(err)
		}
		admin.SetMaxOpenConns(1) // one session: the lock_wait_timeout below is its own
		t.Cleanup(func() {
			// A transaction a failed test left open would make DROP wait for its metadata
			// lock for a year (the default lock_wait_timeout).
			_, _ = admin.Exec("SET SESSION lock_wait_timeout = 10")
			_, _ = admin.Exec("DROP DATABASE IF EXISTS `" + e.schema + "`")
			_ = admin.Close()
		})
		cfg, err := mysql.ParseDSN(mysqlDSN())
		if err != nil {
			t.Fatal(err)
		}
		cfg.DBName = e.schema
		e.dsn = cfg.FormatDSN()
	}
	e.db = e.open(t, e.dsn, maxConns)
	return e
}

// open opens a *sql.DB of maxConns connections on dsn, closed when t ends.
func (e *env) open(t testing.TB, dsn string, maxConns int) *sql.DB {
	t.Helper()
	driver := "pgx"
	if e.dialect == sqlstore.MySQL {
		driver = "mysql"
	} else {
		// The schema's tables only, as a search_path would give them.
		sep := "?"
		if strings.Contains(dsn, "?") {
			sep = "&"
		}
		dsn += sep + "search_path=" + e.schema
	}
	db, err := sql.Open(driver, dsn)
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(maxConns)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// store returns a migrated store on e.
func (e *env) store(t testing.TB, cfg sqlstore.Config) *sqlstore.Store {
	t.Helper()
	cfg.Dialect = e.dialect
	if cfg.Schema == "" {
		cfg.Schema = e.schema
	}
	s, err := sqlstore.New(e.db, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return s
}

// exec runs q on e's database and fails t on error.
func (e *env) exec(t testing.TB, q string, args ...any) {
	t.Helper()
	if _, err := e.db.Exec(q, args...); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

// count returns the single integer q selects.
func (e *env) count(t testing.TB, q string, args ...any) int {
	t.Helper()
	var n int
	if err := e.db.QueryRow(q, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return n
}

// ph is the dialect's n-th placeholder.
func (e *env) ph(n int) string {
	if e.dialect == sqlstore.MySQL {
		return "?"
	}
	return "$" + string(rune('0'+n))
}

// attemptsRow reads k's row in the attempts table: its count, and false when there is none.
func attemptsRow(t testing.TB, s *sqlstore.Store, d sqlstore.Dialect, k contract.Key) (int, bool) {
	t.Helper()
	q := "SELECT attempts FROM " + s.AttemptsTable() + " WHERE message_id = $1 AND consumer_name = $2"
	if d == sqlstore.MySQL {
		q = "SELECT attempts FROM " + s.AttemptsTable() + " WHERE message_id = ? AND consumer_name = ?"
	}
	var n int
	err := s.DB().QueryRow(q, k.MessageID, k.ConsumerName).Scan(&n)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return n, true
}

// processedRows counts the inbox rows of s.
func processedRows(t testing.TB, s *sqlstore.Store) int {
	t.Helper()
	var n int
	if err := s.DB().QueryRow("SELECT count(*) FROM " + s.Table()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// tracked ends, when the test ends, every transaction left open (some conformance cases end
// with a claim decided Run), before the *sql.DB closes.
type tracked struct {
	contract.Store
	mu   sync.Mutex
	open []func()
}

func track(t *testing.T, s contract.Store) *tracked {
	tr := &tracked{Store: s}
	t.Cleanup(func() {
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
		tr.open = append(tr.open, func() { _, _ = tx.Fail(context.Background(), contract.Failure{}) })
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

func payloadHash(p string) []byte {
	h := sha256.Sum256([]byte(p))
	return h[:]
}

func plain(id string) contract.Delivery {
	return contract.Delivery{Key: contract.Key{MessageID: id, ConsumerName: "c"}, PayloadHash: payloadHash("p")}
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// mustClaim claims d and fails t unless it decides want.
func mustClaim(t testing.TB, s contract.Store, d contract.Delivery, want contract.Decision) contract.Tx {
	t.Helper()
	tx, c, err := s.Claim(ctxT(t), d)
	if err != nil {
		t.Fatalf("claim %q: %v", d.Key.MessageID, err)
	}
	if c.Decision != want {
		if tx != nil {
			_, _ = tx.Fail(context.Background(), contract.Failure{})
		}
		t.Fatalf("claim %q: decision %d, want %d (%+v)", d.Key.MessageID, c.Decision, want, c)
	}
	return tx
}
