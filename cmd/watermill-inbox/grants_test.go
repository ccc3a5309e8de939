package main

import (
	"strings"
	"testing"
)

// TestGrantsPrintsTheApplicationRolesGrants: the statements name the role quoted, USAGE on
// the schema (never CREATE), the inbox, attempts and version tables, and with --outbox the
// outbox table, its sequence and the relay's offsets table; a role with a control character
// or no role at all is refused.
func TestGrantsPrintsTheApplicationRolesGrants(t *testing.T) {
	out, err := run(t, "grants", "--role", "billing-app", "--schema", "billing", "--outbox", "--outbox-topic", "receipts")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`GRANT USAGE ON SCHEMA "billing" TO "billing-app";`,
		`GRANT SELECT, INSERT, DELETE ON "billing"."inbox_processed_messages" TO "billing-app";`,
		`GRANT SELECT, INSERT, UPDATE, DELETE ON "billing"."inbox_processed_messages_attempts" TO "billing-app";`,
		`GRANT SELECT ON "billing"."watermill_inbox_migrations" TO "billing-app";`,
		`GRANT SELECT, INSERT, DELETE ON "billing"."watermill_receipts" TO "billing-app";`,
		`GRANT USAGE ON SEQUENCE "billing"."watermill_receipts_offset_seq" TO "billing-app";`,
		`GRANT SELECT, INSERT, UPDATE ON "billing"."watermill_offsets_receipts" TO "billing-app";`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %s in:\n%s", want, out)
		}
	}
	if strings.Contains(out, "CREATE") {
		t.Errorf("a CREATE privilege is granted:\n%s", out)
	}
	if strings.Contains(out, "_consumers") {
		t.Errorf("the text layout's grants name the compact layout's consumers table:\n%s", out)
	}
	compact, err := run(t, "grants", "--role", "billing-app", "--schema", "billing", "--layout", "compact")
	if err != nil || !strings.Contains(compact, `GRANT SELECT, INSERT ON "billing"."inbox_processed_messages_consumers" TO "billing-app";`) {
		t.Errorf("grants --layout compact: %v, no INSERT on the consumers table:\n%s", err, compact)
	}
	d, err := run(t, "grants", "--role", "billing-app", "--schema", "billing", "--deferred")
	if err != nil || !strings.Contains(d, `GRANT SELECT, INSERT, UPDATE, DELETE ON "billing"."inbox_deferred" TO "billing-app";`) {
		t.Errorf("grants --deferred: %v, no grant on the store-then-process table:\n%s", err, d)
	}
	if _, err := run(t, "grants", "--role", "app", "--layout", "tiny"); exitCode(err) != exitUsage {
		t.Errorf("grants --layout tiny: %v, want a usage error", err)
	}
	for _, args := range [][]string{{"grants"}, {"grants", "--role", "app\nGRANT ALL"}, {"grants", "--role", "app", "--schema", "bad-schema"}} {
		if _, err := run(t, args...); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
}

// TestDatabaseURLPasswordNeverPrinted: a PostgreSQL URL with a password and a bad port fails
// without printing the password (pgx masks it; the CLI adds nothing that does not).
func TestDatabaseURLPasswordNeverPrinted(t *testing.T) {
	out, err := run(t, "migrate", "--database-url", "postgres://user:secret@127.0.0.1:badport/app")
	if err == nil {
		t.Fatal("migrate with a bad port succeeded")
	}
	if strings.Contains(out, "secret") || strings.Contains(err.Error(), "secret") {
		t.Fatalf("password printed:\n%s\n%v", out, err)
	}
}
