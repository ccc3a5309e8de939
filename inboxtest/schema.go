package inboxtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/ident"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// Schema is a fresh PostgreSQL schema for one test, dropped when the test ends.
type Schema struct {
	// Name is the unquoted schema name, e.g. "billing_3f9a1c2b7e".
	Name string
	// URL is DatabaseURL with search_path set to Name, for child processes.
	URL string
	// Pool connects with search_path = Name.
	Pool *pgxpool.Pool
}

// NewSchema creates a uniquely named schema, prefix followed by "_" and 10 hex digits, in the
// database at DatabaseURL, returns a pool of maxConns connections whose search_path is that
// schema, and drops the schema (CASCADE) when t ends. prefix names the tests' schemas, so a
// team's own schemas are told apart (letters, digits and underscores, at most 40 bytes). It
// skips t under -short and fails t when PostgreSQL is unreachable or prefix is not a valid
// name.
func NewSchema(t testing.TB, prefix string, maxConns int32) *Schema {
	t.Helper()
	SkipShort(t, "PostgreSQL")
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, DatabaseURL())
	if err != nil {
		t.Fatalf("PostgreSQL is not reachable at INBOX_DATABASE_URL=%q: %v\nif it is down, start it (Debian: pg_ctlcluster <version> main start, or make services); if the database or role is missing, see the README's quick start\n(go test -short runs only the tests that need no service)", redact.ConnString(DatabaseURL()), err)
	}
	defer admin.Close(context.Background())
	var b [5]byte
	_, _ = rand.Read(b[:])
	if err := ident.Validate("schema prefix", prefix, 40); err != nil {
		t.Fatal(err)
	}
	name := prefix + "_" + hex.EncodeToString(b[:])
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	u, err := url.Parse(DatabaseURL())
	if err != nil {
		t.Fatalf("parse INBOX_DATABASE_URL %s: invalid URL", redact.ConnString(DatabaseURL())) // url.Error would print the password
	}
	q := u.Query()
	q.Set("search_path", name)
	u.RawQuery = q.Encode()
	s := &Schema{Name: name, URL: u.String()}
	s.Pool = NewPool(t, s.URL, maxConns)
	t.Cleanup(func() {
		s.Pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, DatabaseURL())
		if err != nil {
			t.Errorf("drop schema %s: %v", name, err)
			return
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", name, err)
		}
	})
	return s
}

// NewPool opens a pool of maxConns connections on dsn, pings it, and closes it when t ends. It
// skips t under -short and fails t when PostgreSQL is unreachable within 15 s.
func NewPool(t testing.TB, dsn string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	SkipShort(t, "PostgreSQL")
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatalf("parse database URL: %v", err)
	}
	cfg.MaxConns = maxConns
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		t.Fatalf("PostgreSQL is not reachable at %q: %v", redact.ConnString(dsn), err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Store returns a pgstore.Store for the inbox table in s, migrated; it fails t on error.
func (s *Schema) Store(t testing.TB) *pgstore.Store {
	t.Helper()
	store, err := pgstore.New(s.Pool, pgstore.Config{Schema: s.Name})
	if err != nil {
		t.Fatalf("pgstore.New: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if _, err := store.Migrate(ctx); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	t.Cleanup(func() { _ = store.Close() })
	return store
}

// Exec runs sql on s's pool and fails t on error.
func (s *Schema) Exec(t testing.TB, sql string, args ...any) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if _, err := s.Pool.Exec(ctx, sql, args...); err != nil {
		t.Fatalf("%.60s: %v", sql, err)
	}
}

// CreateAccounts creates the business table of the tests, accounts (id int, balance bigint
// in cents), with accounts 1..n at balance 0.
func (s *Schema) CreateAccounts(t testing.TB, n int) {
	t.Helper()
	s.Exec(t, "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)")
	s.Exec(t, "INSERT INTO accounts (id) SELECT generate_series(1, $1::int)", n)
}
