package testenv

import (
	"context"
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// GrantedRole creates a LOGIN role named after sch (sch.Name + "_app"), runs every statement
// grants returns for it (one a line, "--" comments skipped: the text pgstore.GrantSQL and its
// siblings print), checks that it may create neither in sch nor in the database (otherwise a test of
// least privilege would prove nothing), drops it when t ends, and returns the role and sch's
// URL logged in as it.
func GrantedRole(t testing.TB, sch *Schema, grants func(role string) (string, error)) (role, roleURL string) {
	t.Helper()
	role = sch.Name + "_app"
	ident := pgx.Identifier{role}.Sanitize()
	sch.Exec(t, "CREATE ROLE "+ident+" LOGIN")
	t.Cleanup(func() {
		_, _ = sch.Pool.Exec(context.Background(), "DROP OWNED BY "+ident)
		_, _ = sch.Pool.Exec(context.Background(), "DROP ROLE "+ident)
	})
	text, err := grants(role)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(text, "\n") {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "--") {
			sch.Exec(t, line)
		}
	}
	var create bool
	if err := sch.Pool.QueryRow(context.Background(), "SELECT has_schema_privilege($1, $2, 'CREATE') OR has_database_privilege($1, current_database(), 'CREATE')",
		role, sch.Name).Scan(&create); err != nil || create {
		t.Fatalf("the role %s may create (%v, %v): a least-privilege test would prove nothing", role, create, err)
	}
	u, err := url.Parse(sch.URL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	return role, u.String()
}
