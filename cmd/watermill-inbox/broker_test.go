package main

import (
	"context"
	"strings"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

// TestBrokerTopics: `migrate --broker-topics` prints (--print) and creates the postgres
// broker's topic tables, `grants --broker-topics` prints their grants (no CREATE), and an
// invalid topic is refused before anything connects.
func TestBrokerTopics(t *testing.T) {
	out, err := run(t, "migrate", "--print", "--broker-topics", "payments,receipts", "--broker-schema", "billing")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"-- the postgres broker's topics\nBEGIN;\n",
		`CREATE TABLE IF NOT EXISTS "billing"."watermill_payments" (`,
		`CREATE TABLE IF NOT EXISTS "billing"."watermill_offsets_receipts" (`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("migrate --print lacks %q:\n%s", want, out)
		}
	}
	out, err = run(t, "grants", "--role", "app", "--broker-topics", "payments", "--broker-schema", "billing")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`GRANT SELECT, INSERT ON "billing"."watermill_payments" TO "app";`,
		`GRANT USAGE ON SEQUENCE "billing"."watermill_payments_offset_seq" TO "app";`,
		`GRANT SELECT, INSERT, UPDATE ON "billing"."watermill_offsets_payments" TO "app";`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("grants lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "CREATE") {
		t.Errorf("a CREATE privilege is granted:\n%s", out)
	}
	if _, err := run(t, "migrate", "--database-url", "postgres://127.0.0.1:1/none", "--broker-topics", "pay ments"); err == nil || !strings.Contains(err.Error(), "pay ments") {
		t.Errorf("an invalid topic: %v", err)
	}

	sch := testenv.NewSchema(t, 2)
	if _, err := run(t, "migrate", "--database-url", testenv.DatabaseURL(), "--schema", sch.Name,
		"--broker-topics", "payments", "--broker-schema", sch.Name); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := sch.Pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_tables WHERE schemaname = $1
		AND tablename IN ('watermill_payments', 'watermill_offsets_payments')`, sch.Name).Scan(&n); err != nil || n != 2 {
		t.Fatalf("topic tables after migrate: %d, %v; want 2", n, err)
	}
}
