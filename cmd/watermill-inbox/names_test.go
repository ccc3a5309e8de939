package main

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

// TestGrantsRefuseNamesPostgresReadsOtherwise: every role, schema or table name that
// PostgreSQL would read as something other than the name it spells is refused with a usage
// error (exit 2) naming it, and nothing is printed to run. The state check: whatever grants
// printed is run as the schema's owner on a migrated schema, and a role created without any
// grant must still be unable to read the inbox table (GRANT ... TO "public" reaches it).
func TestGrantsRefuseNamesPostgresReadsOtherwise(t *testing.T) {
	sch := testenv.NewSchema(t, 1)
	ctx := context.Background()
	if out, err := run(t, "migrate", "--database-url", testenv.DatabaseURL(), "--schema", sch.Name, "--outbox"); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	bystander := sch.Name + "_bystander"
	sch.Exec(t, "CREATE ROLE "+pgx.Identifier{bystander}.Sanitize())
	t.Cleanup(func() {
		_, _ = sch.Pool.Exec(context.Background(), "DROP OWNED BY "+pgx.Identifier{bystander}.Sanitize())
		_, _ = sch.Pool.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{bystander}.Sanitize())
	})
	for _, tc := range []struct {
		name string
		args []string
		want string // in the error
	}{
		{"public", []string{"--role", "public"}, "PUBLIC"},
		{"PUBLIC", []string{"--role", "PUBLIC"}, "PUBLIC"},
		{"none", []string{"--role", "none"}, "reserves"},
		{"current_user", []string{"--role", "current_user"}, "current_user"},
		{"session_user", []string{"--role", "session_user"}, "session_user"},
		{"current_role", []string{"--role", "current_role"}, "current_role"},
		{"user", []string{"--role", "user"}, "CURRENT_USER"},
		{"predefined role", []string{"--role", "pg_write_all_data"}, "pg_"},
		{"folds", []string{"--role", "App"}, `"app"`},
		{"trailing space", []string{"--role", "app "}, "white space"},
		{"zero-width space", []string{"--role", "a\u200bpp"}, "invisible"},
		{"pg_temp schema", []string{"--role", "app", "--schema", "pg_temp"}, "pg_"},
		{"pg_catalog schema", []string{"--role", "app", "--schema", "pg_catalog"}, "pg_"},
		{"information_schema", []string{"--role", "app", "--schema", "information_schema"}, "catalog"},
		{"pg_ table", []string{"--role", "app", "--schema", sch.Name, "--table", "pg_inbox"}, "pg_"},
		{"pg_ deferred table", []string{"--role", "app", "--schema", sch.Name, "--deferred", "--deferred-table", "pg_deferred"}, "pg_"},
		{"outbox in pg_temp", []string{"--role", "app", "--schema", "pg_temp", "--outbox"}, "pg_"},
		{"public with outbox", []string{"--role", "public", "--schema", sch.Name, "--outbox", "--deferred"}, "PUBLIC"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"grants"}, tc.args...)
			if !strings.Contains(strings.Join(tc.args, " "), "--schema") {
				args = append(args, "--schema", sch.Name)
			}
			out, err := run(t, args...)
			if exitCode(err) != exitUsage || err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("grants %q: exit %d, %v; want exit 2 and an error containing %q", tc.args, exitCode(err), err, tc.want)
			}
			// Run what was printed, as the owner would.
			for _, line := range strings.Split(out, "\n") {
				if strings.HasPrefix(line, "GRANT ") {
					_, _ = sch.Pool.Exec(ctx, line)
				}
			}
			var reach bool
			if err := sch.Pool.QueryRow(ctx, "SELECT has_table_privilege($1, $2, 'SELECT')", bystander, sch.Name+".inbox_processed_messages").Scan(&reach); err != nil || reach {
				t.Fatalf("a role without grants may read the inbox table after grants %q (%v, %v):\n%s", tc.args, reach, err, out)
			}
		})
	}
	// Every command checks its --schema, --table and --deferred-table before connecting
	// (pg_temp would put the tables in the connection's temporary schema).
	for _, args := range [][]string{
		{"migrate", "--schema", "pg_temp"},
		{"migrate", "--print", "--schema", "pg_temp"},
		{"migrate", "--schema", sch.Name, "--table", "pg_inbox"},
		{"stats", "--schema", "information_schema"},
		{"partitions", "list", "--schema", "pg_catalog"},
		{"deferred", "migrate", "--schema", "pg_temp"},
		{"deferred", "stats", "--consumer", "billing", "--schema", sch.Name, "--table", "pg_deferred"},
	} {
		out, err := run(t, append(args, "--database-url", testenv.DatabaseURL())...)
		if exitCode(err) != exitUsage || !strings.Contains(out, "invalid configuration") || strings.Contains(out, "CREATE") {
			t.Errorf("%q: exit %d, %v, want exit 2 before anything runs:\n%s", args, exitCode(err), err, out)
		}
	}
	// Names that read as themselves still work.
	for _, role := range []string{"billing-app", "app_1", "публика"} {
		if out, err := run(t, "grants", "--role", role, "--schema", sch.Name, "--outbox", "--deferred"); err != nil || !strings.Contains(out, pgx.Identifier{role}.Sanitize()) {
			t.Errorf("grants --role %q: %v\n%s", role, err, out)
		}
	}
}
