package migrate_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/migrate"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

func set(schema string, files fstest.MapFS) migrate.Set {
	t := pgx.Identifier{schema, "things"}.Sanitize()
	return migrate.Set{
		Prefix: "test", Files: files, Dir: "m",
		Data:   map[string]string{"Table": t},
		Schema: schema, Table: t, Tables: []string{t},
	}
}

var one = fstest.MapFS{
	"m/0001_create.sql": {Data: []byte("CREATE TABLE {{.Table}} (id int PRIMARY KEY);")},
}

var two = fstest.MapFS{
	"m/0001_create.sql": one["m/0001_create.sql"],
	"m/0002_add.sql":    {Data: []byte("ALTER TABLE {{.Table}} ADD COLUMN note text;")},
}

// TestMigrationsRendersSortsAndRefuses: files are rendered with quoted names and sorted by
// their numeric prefix (10 after 9); a file without a prefix and a template naming a missing
// key are errors that name the file.
func TestMigrationsRendersSortsAndRefuses(t *testing.T) {
	ms, err := set("s", fstest.MapFS{
		"m/0010_ten.sql":  {Data: []byte("-- {{.Table}}")},
		"m/0009_nine.sql": {Data: []byte("-- nine")},
	}).Migrations()
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 2 || ms[0].Version != 9 || ms[1].Version != 10 || ms[1].SQL != `-- "s"."things"` {
		t.Fatalf("migrations: %+v", ms)
	}
	for name, data := range map[string]string{"m/create.sql": "SELECT 1", "m/0001_x.sql": "{{.Nope}}", "m/0000_zero.sql": "SELECT 1"} {
		_, err := set("s", fstest.MapFS{name: {Data: []byte(data)}}).Migrations()
		if err == nil || !strings.HasPrefix(err.Error(), "test: migration") || !strings.Contains(err.Error(), name[2:]) {
			t.Errorf("%s: err %v, want a test: migration error naming the file", name, err)
		}
	}
}

// TestApplyChecksThenAppliesOnlyWhatIsPending: on a schema that does not exist Check names
// both tables and the migration; Apply creates the schema, applies and records it; a new file
// is then the only one pending and the only one applied; on a current schema Apply takes no
// lock (it returns while another session holds it) and writes nothing.
func TestApplyChecksThenAppliesOnlyWhatIsPending(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	ctx := context.Background()
	name := sch.Name + "_m"
	t.Cleanup(func() { sch.Exec(t, "DROP SCHEMA IF EXISTS "+pgx.Identifier{name}.Sanitize()+" CASCADE") })

	st, err := set(name, one).Check(ctx, sch.Pool)
	if err != nil || st.Current() || len(st.Missing) != 2 || len(st.Pending) != 1 {
		t.Fatalf("Check before Apply: %+v, %v", st, err)
	}
	applied, locked, err := set(name, one).Apply(ctx, sch.Pool, nil)
	if err != nil || !locked || len(applied) != 1 || applied[0] != 1 {
		t.Fatalf("first Apply: %v, %v, %v", applied, locked, err)
	}
	verified := 0
	verify := func(ctx context.Context, tx pgx.Tx) error {
		verified++
		_, err := tx.Exec(ctx, "SELECT note FROM "+pgx.Identifier{name, "things"}.Sanitize())
		return err
	}
	applied, locked, err = set(name, two).Apply(ctx, sch.Pool, verify)
	if err != nil || !locked || len(applied) != 1 || applied[0] != 2 || verified != 1 {
		t.Fatalf("Apply of the second file: %v, %v, %v (verified %d)", applied, locked, err, verified)
	}
	var recorded int
	if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{name, migrate.VersionsTable}.Sanitize()+
		" WHERE table_name = $1", set(name, two).Table).Scan(&recorded); err != nil || recorded != 2 {
		t.Fatalf("recorded versions %d (%v), want 2", recorded, err)
	}

	// Another session holds the migration lock: a current schema must not wait for it.
	holder, err := sch.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", migrate.LockKey); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	applied, locked, err = set(name, two).Apply(short, sch.Pool, verify)
	if err != nil || locked || len(applied) != 0 || verified != 2 {
		t.Fatalf("Apply on a current schema: %v, locked %v, %v (verified %d)", applied, locked, err, verified)
	}
	boom := errors.New("boom")
	if _, _, err := set(name, two).Apply(short, sch.Pool, func(context.Context, pgx.Tx) error { return boom }); !errors.Is(err, boom) {
		t.Fatalf("Apply on a current schema returned %v, want the verify error", err)
	}
}

// TestScriptRecordsEveryVersion: the script creates the schema, the version table and records
// each version under the quoted table as a literal.
func TestScriptRecordsEveryVersion(t *testing.T) {
	s := set("o'brien", two)
	script, err := s.Script("a title")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`-- a title for table "o'brien"."things"`,
		`CREATE SCHEMA IF NOT EXISTS "o'brien";`,
		`VALUES ('"o''brien"."things"', 1) ON CONFLICT DO NOTHING;`,
		`VALUES ('"o''brien"."things"', 2) ON CONFLICT DO NOTHING;`,
		"COMMIT;",
	} {
		if !strings.Contains(script, want) {
			t.Errorf("script lacks %q:\n%s", want, script)
		}
	}
}
