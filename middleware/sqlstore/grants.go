package sqlstore

import (
	"fmt"
	"strings"

	"github.com/watermill-inbox/watermill-inbox/internal/ident"
)

// GrantSQL returns the GRANT statements that let user (a PostgreSQL role, or a MySQL account
// 'user'@'%') run the inbox of cfg with nothing more, one statement a line, for the tables'
// owner to run after the migrations:
//
//   - the inbox table: SELECT (a duplicate's stored hash), INSERT (the claim), DELETE (a
//     batch member dropped, Purge); on MySQL also UPDATE, which the claim's no-op ON
//     DUPLICATE KEY UPDATE needs on every column it inserts (MariaDB checks each: 1143);
//   - the attempts table: SELECT, INSERT, UPDATE, DELETE (the durable count, dead letters,
//     Replay);
//   - the version table: SELECT (Migrate when nothing is pending);
//   - PostgreSQL: USAGE on the schema (not CREATE).
//
// Advisory locks (pg_try_advisory_xact_lock, GET_LOCK) need no privilege. The user must
// exist. On MySQL, user is validated as an identifier (letters, digits, underscores) and
// granted at host '%'; edit the host in the script for a narrower account. Errors wrap
// inbox.ErrInvalidConfig.
func GrantSQL(cfg Config, user string) (string, error) {
	s, err := newNames(cfg)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	if s.d.sessionLock {
		if err := ident.Validate("user name", user, 32); err != nil {
			return "", err
		}
		u := "'" + user + "'@'%'"
		fmt.Fprintf(&b, "GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO %s;\n", s.table, u)
		fmt.Fprintf(&b, "GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO %s;\n", s.attempts, u)
		fmt.Fprintf(&b, "GRANT SELECT ON %s TO %s;\n", s.versions, u)
		return b.String(), nil
	}
	if err := ident.GrantObject("schema name", s.cfg.Schema); err != nil {
		return "", err
	}
	if err := ident.Role(user); err != nil {
		return "", err
	}
	r := s.d.quote(user)
	fmt.Fprintf(&b, "GRANT USAGE ON SCHEMA %s TO %s;\n", s.d.quote(s.cfg.Schema), r)
	fmt.Fprintf(&b, "GRANT SELECT, INSERT, DELETE ON %s TO %s;\n", s.table, r)
	fmt.Fprintf(&b, "GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO %s;\n", s.attempts, r)
	fmt.Fprintf(&b, "GRANT SELECT ON %s TO %s;\n", s.versions, r)
	return b.String(), nil
}
