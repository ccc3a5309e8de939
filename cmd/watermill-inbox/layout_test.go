package main

import (
	"context"
	"crypto/sha256"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// textTable creates the text-layout table ops_inbox in sch and commits a claim of each id
// (consumer billing, payload hash sha256(id)).
func textTable(t *testing.T, sch *testenv.Schema, ids ...string) *pgstore.Store {
	t.Helper()
	ctx := context.Background()
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Table: "ops_inbox"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		h := sha256.Sum256([]byte(id))
		tx, res, err := s.Claim(ctx, contract.Delivery{Key: contract.Key{MessageID: id, ConsumerName: "billing"}, PayloadHash: h[:]})
		if err != nil || res.Decision != contract.Run {
			t.Fatalf("claim %s: %+v %v", id, res, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return s
}

// tableState returns the detected layout of ops_inbox, its rows, and whether ops_inbox_old exists.
func tableState(t *testing.T, sch *testenv.Schema) (string, int, bool) {
	t.Helper()
	ctx := context.Background()
	cfg, err := pgstore.DetectLayout(ctx, sch.Pool, pgstore.Config{Schema: sch.Name, Table: "ops_inbox"})
	if err != nil {
		t.Fatal(err)
	}
	var rows int
	var old bool
	if err := sch.Pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM ops_inbox), to_regclass('ops_inbox_old') IS NOT NULL").Scan(&rows, &old); err != nil {
		t.Fatal(err)
	}
	return describeLayout(cfg), rows, old
}

// TestLayoutConvert: --print and --dry-run change nothing (the table stays in the text layout
// with its rows, no <table>_old); the conversion to the compact layout keeps every row, and
// afterwards the old messages are still caught as duplicates (with their hash prefix), a new
// one is claimed, stats and purge read the compact table, and converting again does nothing.
func TestLayoutConvert(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	ctx := context.Background()
	ids := []string{uuid.NewString(), uuid.NewString(), uuid.NewString()}
	textTable(t, sch, ids...)
	db := []string{"--database-url", testenv.DatabaseURL(), "--schema", sch.Name, "--table", "ops_inbox"}
	unchanged := func(step string) {
		t.Helper()
		if layout, rows, old := tableState(t, sch); layout != "text" || rows != 3 || old {
			t.Fatalf("after %s: layout %s, %d rows, ops_inbox_old exists %v; want text, 3 rows, none", step, layout, rows, old)
		}
	}

	t.Setenv("INBOX_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	out, err := run(t, "layout", "convert", "--to", "compact", "--print", "--schema", sch.Name, "--table", "ops_inbox")
	if err != nil || !strings.Contains(out, "received_minute") || !strings.Contains(out, "LOCK TABLE") {
		t.Fatalf("convert --print (no database URL): %v\n%s", err, out)
	}
	unchanged("--print")

	out, err = run(t, append([]string{"layout", "convert", "--to", "compact", "--dry-run"}, db...)...)
	if err != nil || !strings.Contains(out, "rows to copy 3; keys the new layout cannot hold 0") || !strings.Contains(out, "nothing changed") {
		t.Fatalf("convert --dry-run: %v\n%s", err, out)
	}
	unchanged("--dry-run")

	// UUIDv4 keys cannot be partitioned by key time: refused (4), nothing changed.
	out, err = run(t, append([]string{"layout", "convert", "--to", "compact", "--partitioned", "daily", "--dry-run"}, db...)...)
	if exitCode(err) != exitRefused || !strings.Contains(err.Error(), "3 rows have a message_id that is not a canonical lowercase UUIDv7") {
		t.Fatalf("convert --partitioned daily over UUIDv4 keys: exit %d, %v\n%s", exitCode(err), err, out)
	}
	unchanged("a refused dry run")

	out, err = run(t, append([]string{"layout", "convert", "--to", "compact"}, db...)...)
	if err != nil || !strings.Contains(out, "3 rows in") || !strings.Contains(out, "3 kept in") {
		t.Fatalf("convert --to compact: %v\n%s", err, out)
	}
	if layout, rows, old := tableState(t, sch); layout != "compact" || rows != 3 || !old {
		t.Fatalf("after the conversion: layout %s, %d rows, ops_inbox_old %v; want compact, 3, kept", layout, rows, old)
	}
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Table: "ops_inbox", Layout: pgstore.LayoutCompact})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		h := sha256.Sum256([]byte(id))
		tx, res, err := s.Claim(ctx, contract.Delivery{Key: contract.Key{MessageID: id, ConsumerName: "billing"}, PayloadHash: h[:]})
		if err != nil || res.Decision != contract.Duplicate || tx != nil {
			t.Fatalf("old message %s after the conversion: %+v %v; want a duplicate", id, res, err)
		}
		// The hash prefix kept tells another payload apart.
		other := sha256.Sum256([]byte("another " + id))
		if string(other[:2]) != string(h[:2]) {
			tx, res, err := s.Claim(ctx, contract.Delivery{Key: contract.Key{MessageID: id, ConsumerName: "billing"}, PayloadHash: other[:]})
			if err != nil || res.Decision != contract.Collision || tx != nil {
				t.Fatalf("old message %s with another payload after the conversion: %+v %v; want a collision", id, res, err)
			}
		}
	}
	tx, res, err := s.Claim(ctx, contract.Delivery{Key: contract.Key{MessageID: uuid.NewString(), ConsumerName: "billing"}})
	if err != nil || res.Decision != contract.Run {
		t.Fatalf("new claim after the conversion: %+v %v", res, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	out, err = run(t, append([]string{"stats"}, db...)...)
	if err != nil || !strings.Contains(out, `"billing": 4 rows`) {
		t.Fatalf("stats on the compact table: %v\n%s", err, out)
	}
	out, err = run(t, append([]string{"purge", "--window", "14d", "--dry-run"}, db...)...)
	if err != nil || !strings.Contains(out, "would delete 0 rows") {
		t.Fatalf("purge --dry-run on the compact table: %v\n%s", err, out)
	}
	out, err = run(t, append([]string{"layout", "show"}, db...)...)
	if err != nil || !strings.Contains(out, "ops_inbox\": compact") {
		t.Fatalf("layout show: %v\n%s", err, out)
	}
	out, err = run(t, append([]string{"layout", "convert", "--to", "compact"}, db...)...)
	if err != nil || !strings.Contains(out, "nothing to do") {
		t.Fatalf("converting again: %v\n%s", err, out)
	}
	// Back to text is not a conversion the tool does: refused, nothing changed.
	out, err = run(t, append([]string{"layout", "convert", "--to", "text"}, db...)...)
	if exitCode(err) != exitRefused {
		t.Fatalf("convert --to text from compact: exit %d, %v\n%s", exitCode(err), err, out)
	}
	if layout, rows, _ := tableState(t, sch); layout != "compact" || rows != 4 {
		t.Fatalf("after the refused conversion: %s, %d rows", layout, rows)
	}
}

// TestLayoutConvertRefusals: a table holding a key the compact layout cannot hold, a table
// whose <table>_old exists, and a table another transaction is using are left as they were,
// with exit statuses 4, 4 and 1; a bad flag is a usage error (2); a URL's password is never
// printed.
func TestLayoutConvertRefusals(t *testing.T) {
	ctx := context.Background()
	sch := testenv.NewSchema(t, 3)
	textTable(t, sch, uuid.NewString(), "order-7", uuid.NewString())
	db := []string{"--database-url", testenv.DatabaseURL(), "--schema", sch.Name, "--table", "ops_inbox"}
	out, err := run(t, append([]string{"layout", "convert", "--to", "compact"}, db...)...)
	if exitCode(err) != exitRefused || !strings.Contains(err.Error(), "1 rows have a message_id that is not a canonical lowercase UUID") {
		t.Fatalf("a text key: exit %d, %v\n%s", exitCode(err), err, out)
	}
	if layout, rows, old := tableState(t, sch); layout != "text" || rows != 3 || old {
		t.Fatalf("after refusing a text key: %s, %d rows, old %v", layout, rows, old)
	}
	sch.Exec(t, "DELETE FROM ops_inbox WHERE message_id = 'order-7'")

	sch.Exec(t, "CREATE TABLE ops_inbox_old (x int)")
	out, err = run(t, append([]string{"layout", "convert", "--to", "compact"}, db...)...)
	if exitCode(err) != exitRefused || !strings.Contains(err.Error(), "ops_inbox_old\" exists") {
		t.Fatalf("<table>_old exists: exit %d, %v\n%s", exitCode(err), err, out)
	}
	sch.Exec(t, "DROP TABLE ops_inbox_old")

	// A transaction using the table (a slow handler's claim would do the same): the
	// conversion gives up after --lock-timeout and changes nothing.
	tx, err := sch.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT count(*) FROM ops_inbox"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	out, err = run(t, append([]string{"layout", "convert", "--to", "compact", "--lock-timeout", "300ms"}, db...)...)
	if exitCode(err) != exitError || !strings.Contains(err.Error(), "lock was not granted") || time.Since(start) > 10*time.Second {
		t.Fatalf("a busy table: exit %d, %v (after %s)\n%s", exitCode(err), err, time.Since(start), out)
	}
	_ = tx.Rollback(ctx)
	if layout, rows, old := tableState(t, sch); layout != "text" || rows != 2 || old {
		t.Fatalf("after the lock timeout: %s, %d rows, old %v; want text, 2, none", layout, rows, old)
	}

	for _, bad := range [][]string{{"--to", "bogus"}, {"--to", "compact", "--partitioned", "weekly"}, {}} {
		_, err := run(t, append(append([]string{"layout", "convert"}, bad...), db...)...)
		if exitCode(err) != exitUsage {
			t.Fatalf("convert %v: exit %d (%v); want %d", bad, exitCode(err), err, exitUsage)
		}
	}
	out, err = run(t, "layout", "convert", "--to", "compact", "--database-url", "postgres://postgres:s3cret-pw@127.0.0.1:1/test?connect_timeout=2", "--schema", sch.Name, "--table", "ops_inbox")
	if exitCode(err) != exitError || strings.Contains(out+err.Error(), "s3cret-pw") {
		t.Fatalf("an unreachable database: exit %d, %v\n%s", exitCode(err), err, out)
	}
	if layout, rows, _ := tableState(t, sch); layout != "text" || rows != 2 {
		t.Fatalf("at the end: %s, %d rows", layout, rows)
	}
}

// TestMigrateKeepsTheTablesLayout: migrate --layout compact creates a compact table; migrate
// without --layout then finds it current (it reads the table's layout, so a compact table's
// pending migrations are applied as compact); --layout text on it is a usage error (2) that
// changes nothing.
func TestMigrateKeepsTheTablesLayout(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	db := []string{"--database-url", testenv.DatabaseURL(), "--schema", sch.Name, "--table", "ops_inbox"}
	out, err := run(t, append([]string{"migrate", "--layout", "compact"}, db...)...)
	if err != nil || !appliedAll.MatchString(out) {
		t.Fatalf("migrate --layout compact: %v\n%s", err, out)
	}
	if layout, rows, _ := tableState(t, sch); layout != "compact" || rows != 0 {
		t.Fatalf("after migrate --layout compact: %s, %d rows", layout, rows)
	}
	out, err = run(t, append([]string{"migrate"}, db...)...)
	if err != nil || !strings.Contains(out, "up to date") {
		t.Fatalf("migrate on the compact table: %v\n%s", err, out)
	}
	out, err = run(t, append([]string{"migrate", "--layout", "text"}, db...)...)
	if exitCode(err) != exitUsage || !strings.Contains(err.Error(), "exists in the compact layout") {
		t.Fatalf("migrate --layout text on a compact table: exit %d, %v\n%s", exitCode(err), err, out)
	}
	if layout, _, _ := tableState(t, sch); layout != "compact" {
		t.Fatalf("after the refused migrate: %s", layout)
	}
}
