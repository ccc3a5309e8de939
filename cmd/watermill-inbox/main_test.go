package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

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
	if err != nil || !strings.Contains(out, "applied migrations [1 2]") {
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
