package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"strings"
	"testing"

	_ "github.com/go-sql-driver/mysql"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

// TestSQLMigrateMySQL: `sql migrate --dialect mysql` creates sqlstore's tables in a fresh
// MariaDB database, then finds them up to date, and with --outbox the outbox table; --print
// needs no database; `sql grants --outbox` adds the outbox table's grants for the dialect; a
// bad dialect, an unsafe table name and an unsafe outbox topic are usage errors before
// connecting.
func TestSQLMigrateMySQL(t *testing.T) {
	testenv.SkipShort(t, "MariaDB")
	admin, err := sql.Open("mysql", "root@tcp(127.0.0.1:3306)/")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = admin.Close() }()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	db := "t_" + hex.EncodeToString(b)
	if _, err := admin.Exec("CREATE DATABASE " + db); err != nil {
		t.Fatalf("MariaDB: %v (start it with: start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd)", err)
	}
	t.Cleanup(func() { _, _ = admin.Exec("DROP DATABASE IF EXISTS " + db) })
	dsn := "root@tcp(127.0.0.1:3306)/" + db
	out, err := run(t, "sql", "migrate", "--dialect", "mysql", "--database-url", dsn)
	if err != nil || !strings.Contains(out, "applied migrations [1 2]") {
		t.Fatalf("first migrate: %v\n%s", err, out)
	}
	out, err = run(t, "sql", "migrate", "--dialect", "mysql", "--database-url", dsn)
	if err != nil || !strings.Contains(out, "up to date") {
		t.Fatalf("second migrate: %v\n%s", err, out)
	}
	var n int
	if err := admin.QueryRow("SELECT count(*) FROM " + db + ".inbox_processed_messages_attempts").Scan(&n); err != nil || n != 0 {
		t.Fatalf("attempts table: %d rows, %v", n, err)
	}
	out, err = run(t, "sql", "migrate", "--print", "--dialect", "mysql", "--table", "ops_inbox")
	if err != nil || !strings.Contains(out, "CREATE TABLE IF NOT EXISTS `ops_inbox`") {
		t.Fatalf("migrate --print: %v\n%s", err, out)
	}
	out, err = run(t, "sql", "grants", "--dialect", "mysql", "--user", "app")
	if err != nil || !strings.Contains(out, "GRANT SELECT, INSERT, UPDATE, DELETE ON `inbox_processed_messages` TO 'app'@'%'") {
		t.Fatalf("grants: %v\n%s", err, out)
	}
	// --outbox: the outbox table (watermill-sql's MySQL queue schema) and its grants.
	out, err = run(t, "sql", "migrate", "--dialect", "mysql", "--database-url", dsn, "--outbox", "--outbox-topic", "receipts")
	if err != nil || !strings.Contains(out, "outbox table for topic receipts: present") {
		t.Fatalf("migrate --outbox: %v\n%s", err, out)
	}
	if err := admin.QueryRow("SELECT count(*) FROM " + db + ".watermill_receipts").Scan(&n); err != nil || n != 0 {
		t.Fatalf("outbox table: %d rows, %v", n, err)
	}
	out, err = run(t, "sql", "migrate", "--print", "--dialect", "mysql", "--outbox")
	if err != nil || !strings.Contains(out, "CREATE TABLE IF NOT EXISTS `watermill_inbox_outbox`") {
		t.Fatalf("migrate --print --outbox: %v\n%s", err, out)
	}
	out, err = run(t, "sql", "grants", "--dialect", "mysql", "--user", "app", "--outbox", "--outbox-topic", "receipts")
	if err != nil || !strings.Contains(out, "GRANT SELECT, INSERT, DELETE ON `watermill_receipts` TO 'app'@'%'") {
		t.Fatalf("grants --outbox: %v\n%s", err, out)
	}
	out, err = run(t, "sql", "grants", "--dialect", "postgres", "--user", "app", "--outbox")
	if err != nil || !strings.Contains(out, "GRANT USAGE ON SEQUENCE") {
		t.Fatalf("grants --dialect postgres --outbox: %v\n%s", err, out)
	}
	for _, args := range [][]string{
		{"sql", "grants", "--dialect", "mysql", "--user", "app", "--outbox", "--outbox-topic", "x`y"},
		{"sql", "migrate", "--dialect", "oracle", "--database-url", dsn},
		{"sql", "migrate", "--dialect", "mysql", "--table", "x`; DROP TABLE y; --", "--database-url", dsn},
	} {
		if _, err := run(t, args...); err == nil || exitCode(err) != 2 {
			t.Errorf("%v: %v, want a usage error", args, err)
		}
	}
}

// TestSQLMigratePostgresOutbox: `sql migrate --dialect postgres --outbox` creates sqlstore's
// tables and the outbox's (watermill-sql's PostgreSQL schema, through a pgx pool on the same
// URL) in a fresh database, then finds both present.
func TestSQLMigratePostgresOutbox(t *testing.T) {
	db := testenv.NewDatabase(t, 2)
	for range 2 {
		out, err := run(t, "sql", "migrate", "--dialect", "postgres", "--database-url", db.URL, "--outbox")
		if err != nil || !strings.Contains(out, "outbox table for topic inbox_outbox: present") {
			t.Fatalf("migrate --outbox: %v\n%s", err, out)
		}
	}
	var n int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM public.watermill_inbox_outbox").Scan(&n); err != nil || n != 0 {
		t.Fatalf("outbox table: %d rows, %v", n, err)
	}
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM public.inbox_processed_messages").Scan(&n); err != nil || n != 0 {
		t.Fatalf("inbox table: %d rows, %v", n, err)
	}
}
