package sqlstore_test

import (
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/sqlstore"
)

// TestMigrateAppliesOnceConcurrently: four instances migrating at once apply each migration
// once (under the migration lock); a later Migrate applies nothing.
func TestMigrateAppliesOnceConcurrently(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		e := newEnv(t, d, 8)
		var wg sync.WaitGroup
		var mu sync.Mutex
		total := 0
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s, err := sqlstore.New(e.db, sqlstore.Config{Dialect: d, Schema: e.schema})
				if err != nil {
					t.Error(err)
					return
				}
				applied, err := s.Migrate(ctxT(t))
				if err != nil {
					t.Error(err)
				}
				mu.Lock()
				total += len(applied)
				mu.Unlock()
			}()
		}
		wg.Wait()
		s := e.store(t, sqlstore.Config{})
		ms, _ := s.Migrations()
		if total != len(ms) {
			t.Fatalf("%d migrations applied in all, want %d (each once)", total, len(ms))
		}
		if applied, err := s.Migrate(ctxT(t)); err != nil || len(applied) != 0 {
			t.Fatalf("second Migrate: %v %v", applied, err)
		}
	})
}

// TestMigrationSQLScript: the script, run by the user's own tool, leaves Migrate nothing to do.
func TestMigrationSQLScript(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		e := newEnv(t, d, 4)
		script, err := sqlstore.MigrationSQL(sqlstore.Config{Dialect: d, Schema: e.schema})
		if err != nil {
			t.Fatal(err)
		}
		for _, stmt := range strings.Split(script, ";\n") {
			var lines []string
			for _, l := range strings.Split(stmt, "\n") {
				if !strings.HasPrefix(strings.TrimSpace(l), "--") {
					lines = append(lines, l)
				}
			}
			if q := strings.TrimSpace(strings.Join(lines, "\n")); q != "" {
				e.exec(t, q)
			}
		}
		s, err := sqlstore.New(e.db, sqlstore.Config{Dialect: d, Schema: e.schema})
		if err != nil {
			t.Fatal(err)
		}
		if applied, err := s.Migrate(ctxT(t)); err != nil || len(applied) != 0 {
			t.Fatalf("Migrate after the script: %v %v, want nothing to do", applied, err)
		}
	})
}

func TestNewRefusesBadConfig(t *testing.T) {
	db := (&env{dialect: sqlstore.MySQL}).open(t, "root@tcp(127.0.0.1:3306)/test", 1)
	for _, cfg := range []sqlstore.Config{
		{},           // no dialect
		{Dialect: 7}, // unknown
		{Dialect: sqlstore.MySQL, Table: "x`; DROP TABLE y; --"},
		{Dialect: sqlstore.PostgreSQL, Schema: "a.b"},
		{Dialect: sqlstore.MySQL, Table: strings.Repeat("t", 48)},
	} {
		if _, err := sqlstore.New(db, cfg); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("New(%+v): %v, want ErrInvalidConfig", cfg, err)
		}
	}
	if _, err := sqlstore.New(nil, sqlstore.Config{Dialect: sqlstore.MySQL}); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("New(nil): %v", err)
	}
}
