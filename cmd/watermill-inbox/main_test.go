package main

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

// appliedAll matches migrate's report of a new table's migrations: 1, 2, 3 and every later one.
var appliedAll = regexp.MustCompile(`applied migrations \[1 2 3( \d+)*\]`)

func run(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := rootCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(context.Background())
	return out.String(), err
}

func TestMigrateAppliesOnceThenIsUpToDate(t *testing.T) {
	sch := testenv.NewSchema(t, 1)
	out, err := run(t, "migrate", "--database-url", testenv.DatabaseURL(), "--schema", sch.Name, "--table", "ops_inbox")
	if err != nil || !appliedAll.MatchString(out) {
		t.Fatalf("first migrate: %v\n%s", err, out)
	}
	out, err = run(t, "migrate", "--database-url", testenv.DatabaseURL(), "--schema", sch.Name, "--table", "ops_inbox")
	if err != nil || !strings.Contains(out, "up to date") {
		t.Fatalf("second migrate: %v\n%s", err, out)
	}
	var n int
	if err := sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM ops_inbox").Scan(&n); err != nil || n != 0 {
		t.Fatalf("table ops_inbox: rows %d, err %v", n, err)
	}
}

func TestMigratePrintNeedsNoDatabase(t *testing.T) {
	t.Setenv("INBOX_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	out, err := run(t, "migrate", "--print", "--schema", "billing", "--table", "inbox")
	if err != nil || !strings.Contains(out, `CREATE TABLE IF NOT EXISTS "billing"."inbox"`) {
		t.Fatalf("migrate --print: %v\n%s", err, out)
	}
}

func TestMigrateRejectsUnsafeNamesBeforeConnecting(t *testing.T) {
	t.Setenv("INBOX_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	out, err := run(t, "migrate", "--table", `inbox"; DROP TABLE accounts; --`)
	if err == nil || !strings.Contains(out, "invalid configuration") {
		t.Fatalf("unsafe table name: err %v\n%s", err, out)
	}
}

// TestMigrateOutboxAndVersion: migrate --outbox creates the outbox tables beside the inbox
// (and --print shows their SQL); --version prints a version; an invalid outbox topic is
// refused before connecting.
func TestMigrateOutboxAndVersion(t *testing.T) {
	sch := testenv.NewSchema(t, 1)
	out, err := run(t, "migrate", "--database-url", testenv.DatabaseURL(), "--schema", sch.Name, "--outbox")
	if err != nil || !strings.Contains(out, "outbox tables") {
		t.Fatalf("migrate --outbox: %v\n%s", err, out)
	}
	var n int
	if err := sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM watermill_inbox_outbox").Scan(&n); err != nil || n != 0 {
		t.Fatalf("outbox table: rows %d, err %v", n, err)
	}
	out, err = run(t, "migrate", "--print", "--outbox", "--outbox-topic", "billing_outbox")
	if err != nil || !strings.Contains(out, "watermill_billing_outbox") || !strings.Contains(out, "inbox_processed_messages") {
		t.Fatalf("migrate --print --outbox: %v\n%s", err, out)
	}
	if _, err := run(t, "migrate", "--database-url", "postgres://nobody@127.0.0.1:1/none", "--outbox", "--outbox-topic", "bad-topic!"); err == nil {
		t.Fatal("an invalid outbox topic was accepted")
	}
	out, err = run(t, "--version")
	if err != nil || !strings.Contains(out, "version") {
		t.Fatalf("--version: %v\n%s", err, out)
	}
}
