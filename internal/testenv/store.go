package testenv

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

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
