package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/redact"
)

// Database is a fresh PostgreSQL database for one test, dropped when the test ends: a
// database per tenant or per shard.
type Database struct {
	// Schema is the database's public schema (Name "public"), with a pool of its own and
	// the Store, Exec and CreateAccounts methods of a test schema.
	*Schema
	// DBName is the unquoted database name, "t_" followed by 10 hex digits.
	DBName string
}

// NewDatabase creates a uniquely named database on the server at DatabaseURL (the role must
// have CREATEDB), returns it with a pool of maxConns connections on it, and drops it (WITH
// (FORCE), PostgreSQL 13 or later, closing what is still connected) when t ends. It skips t
// under -short and fails t when PostgreSQL is unreachable.
func NewDatabase(t testing.TB, maxConns int32) *Database {
	t.Helper()
	SkipShort(t, "PostgreSQL")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, DatabaseURL())
	if err != nil {
		t.Fatalf("PostgreSQL is not reachable at INBOX_DATABASE_URL=%q: %v\n(go test -short runs only the tests that need no service)", redact.ConnString(DatabaseURL()), err)
	}
	defer admin.Close(context.Background())
	var b [5]byte
	_, _ = rand.Read(b[:])
	name := "t_" + hex.EncodeToString(b[:])
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("create database: %v", err)
	}
	// Registered before the pool's cleanup, so it runs after it (cleanups run last first).
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, DatabaseURL())
		if err != nil {
			t.Errorf("drop database %s: %v", name, err)
			return
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	u, err := url.Parse(DatabaseURL())
	if err != nil {
		t.Fatalf("parse INBOX_DATABASE_URL %s: invalid URL", redact.ConnString(DatabaseURL()))
	}
	u.Path = "/" + name
	s := &Schema{Name: "public", URL: u.String()}
	s.Pool = NewPool(t, s.URL, maxConns)
	return &Database{Schema: s, DBName: name}
}
