package pgstore_test

import (
	"context"
	"errors"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestCheckSchemaNamesWhatIsMissingOrPending: before Migrate every table is missing and every
// migration pending; after it the schema is current; a migration whose record is gone is
// named as pending. CheckSchema writes nothing (the version table is untouched by it).
func TestCheckSchemaNamesWhatIsMissingOrPending(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	ctx := context.Background()
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	ms, _ := s.Migrations()
	err = s.CheckSchema(ctx)
	var serr *pgstore.SchemaError
	if !errors.As(err, &serr) || !errors.Is(err, pgstore.ErrSchemaNotCurrent) {
		t.Fatalf("CheckSchema before Migrate: %v, want a *SchemaError", err)
	}
	if len(serr.Missing) != 4 || len(serr.Pending) != len(ms) {
		t.Fatalf("missing %v, pending %v; want 4 tables (inbox, attempts, duplicate ages, versions) and %d migrations", serr.Missing, serr.Pending, len(ms))
	}
	var exists bool
	if err := sch.Pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", s.Table()).Scan(&exists); err != nil || exists {
		t.Fatalf("CheckSchema created the inbox table (%v, %v)", exists, err)
	}
	if _, err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.CheckSchema(ctx); err != nil {
		t.Fatalf("CheckSchema after Migrate: %v", err)
	}
	last := ms[len(ms)-1]
	sch.Exec(t, "DELETE FROM watermill_inbox_migrations WHERE version = $1", last.Version)
	err = s.CheckSchema(ctx)
	if !errors.As(err, &serr) || len(serr.Missing) != 0 || len(serr.Pending) != 1 || serr.Pending[0] != last.Name {
		t.Fatalf("CheckSchema with %s unrecorded: %v", last.Name, err)
	}
	if errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatal("a pending migration is not a configuration error of the Store")
	}
}
