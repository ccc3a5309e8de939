package deferred_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/health"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestCheckSchemaNamesWhatIsMissingOrPending: before Migrate the table and the version table
// are missing and the migration is pending, and CheckSchema creates nothing; after it the
// schema is current (also as a health check) while pgstore's inbox table, sharing the version
// table, is still reported pending; a migration whose record is gone is named as pending, and
// concurrent Migrate calls apply it exactly once.
func TestCheckSchemaNamesWhatIsMissingOrPending(t *testing.T) {
	sch := testenv.NewSchema(t, 8)
	ctx := context.Background()
	ib, err := deferred.New(deferred.Config{Pool: sch.Pool, Schema: sch.Name, ConsumerName: "billing"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ms, err := ib.Migrations()
	if err != nil || len(ms) == 0 {
		t.Fatalf("Migrations: %v, %v", ms, err)
	}
	err = ib.CheckSchema(ctx)
	var serr *deferred.SchemaError
	if !errors.As(err, &serr) || !errors.Is(err, deferred.ErrSchemaNotCurrent) {
		t.Fatalf("CheckSchema before Migrate: %v, want a *SchemaError", err)
	}
	if len(serr.Missing) != 2 || serr.Missing[0] != ib.Table() || len(serr.Pending) != len(ms) || serr.Pending[0] != ms[0].Name {
		t.Fatalf("missing %v, pending %v; want the table and the version table, and %d migrations", serr.Missing, serr.Pending, len(ms))
	}
	if !strings.Contains(err.Error(), "watermill-inbox deferred migrate") || errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("error %q: want the deferred migrate hint, and no configuration error", err)
	}
	var exists bool
	if err := sch.Pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", ib.Table()).Scan(&exists); err != nil || exists {
		t.Fatalf("CheckSchema created the table (%v, %v)", exists, err)
	}

	results := make([][]int, 4)
	errs := make([]error, 4)
	done := make(chan struct{})
	for i := range results {
		go func() { results[i], errs[i] = ib.Migrate(ctx); done <- struct{}{} }()
	}
	total := 0
	for range results {
		<-done
	}
	for i := range results {
		if errs[i] != nil {
			t.Fatalf("concurrent Migrate %d: %v", i, errs[i])
		}
		total += len(results[i])
	}
	if total != len(ms) {
		t.Fatalf("four concurrent Migrate calls applied %d migrations in total, want %d", total, len(ms))
	}
	if err := ib.CheckSchema(ctx); err != nil {
		t.Fatalf("CheckSchema after Migrate: %v", err)
	}
	if err := health.Schema(ib).Run(ctx); err != nil {
		t.Fatalf("health.Schema after Migrate: %v", err)
	}
	store, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	var perr *pgstore.SchemaError
	if err := store.CheckSchema(ctx); !errors.As(err, &perr) || len(perr.Missing) != 3 {
		t.Fatalf("pgstore CheckSchema beside a migrated deferred table: %v, want its three tables missing (processed messages, attempts, duplicate ages)", err)
	}

	last := ms[len(ms)-1]
	sch.Exec(t, "DELETE FROM watermill_inbox_migrations WHERE table_name = $1 AND version = $2", ib.Table(), last.Version)
	err = ib.CheckSchema(ctx)
	if !errors.As(err, &serr) || len(serr.Missing) != 0 || len(serr.Pending) != 1 || serr.Pending[0] != last.Name {
		t.Fatalf("CheckSchema with %s unrecorded: %v", last.Name, err)
	}
}

// TestMigrateOnCurrentSchemaTakesNoLock: with nothing pending, Migrate reads only: it returns
// while another session holds the migration lock, and the version table is unchanged.
func TestMigrateOnCurrentSchemaTakesNoLock(t *testing.T) {
	ib, sch := newInbox(t, deferred.Config{}, 0)
	ctx := context.Background()
	var before time.Time
	if err := sch.Pool.QueryRow(ctx, "SELECT max(applied_at) FROM watermill_inbox_migrations").Scan(&before); err != nil {
		t.Fatal(err)
	}
	holder, err := sch.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtextextended('watermill-inbox:migrate', 0))"); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if applied, err := ib.Migrate(short); err != nil || len(applied) != 0 {
		t.Fatalf("Migrate on a current schema while the lock is held: %v, %v", applied, err)
	}
	var after time.Time
	var rows int
	if err := sch.Pool.QueryRow(ctx, "SELECT max(applied_at), count(*) FROM watermill_inbox_migrations").Scan(&after, &rows); err != nil {
		t.Fatal(err)
	}
	if ms, err := ib.Migrations(); err != nil || !after.Equal(before) || rows != len(ms) {
		t.Fatalf("version table changed: %v -> %v, %d rows", before, after, rows)
	}
}
