package pgstore

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// ValidateRole checks a PostgreSQL role name the project prints into GRANT statements: 1 to
// 63 bytes (NAMEDATALEN-1) of valid UTF-8 without control characters. It is always quoted
// (pgx.Identifier), so any other character is safe. Errors wrap inbox.ErrInvalidConfig.
func ValidateRole(role string) error {
	if role == "" || len(role) > 63 || !utf8.ValidString(role) || strings.IndexFunc(role, unicode.IsControl) >= 0 {
		return fmt.Errorf("%w: role name %q: want 1 to 63 bytes of UTF-8 without control characters", inbox.ErrInvalidConfig, role)
	}
	return nil
}

// GrantSQL returns the GRANT statements that let role run the inbox of cfg with nothing more
// (least privilege), one statement a line, for the schema's owner to run after the
// migrations:
//
//   - USAGE on the schema (not CREATE: the role cannot create tables);
//   - SELECT, INSERT, DELETE on the inbox table: the claim (INSERT ... ON CONFLICT DO
//     NOTHING), the stored payload hash of a duplicate (SELECT), Purge (DELETE);
//   - SELECT, INSERT, UPDATE, DELETE on the attempts table: the durable attempt count
//     (INSERT ... ON CONFLICT DO UPDATE), dead-letter marks, Replay;
//   - SELECT on the version table: CheckSchema, and Migrate when nothing is pending;
//   - in the compact layout (cfg.Layout), SELECT, INSERT on the consumers table: a consumer
//     name is registered by its first claim.
//
// Advisory locks, set_config and the cancel request need no privilege. The handler's own
// tables need their own grants; the outbox's are outbox.GrantSQL. An invalid schema, table
// or role gives an error wrapping inbox.ErrInvalidConfig. The role must exist.
func GrantSQL(cfg Config, role string) (string, error) {
	s, err := newNames(cfg)
	if err != nil {
		return "", err
	}
	if err := ValidateRole(role); err != nil {
		return "", err
	}
	r := pgx.Identifier{role}.Sanitize()
	var b strings.Builder
	fmt.Fprintf(&b, "-- the inbox %s: application role %s\n", s.table, r)
	fmt.Fprintf(&b, "GRANT USAGE ON SCHEMA %s TO %s;\n", pgx.Identifier{s.cfg.Schema}.Sanitize(), r)
	fmt.Fprintf(&b, "GRANT SELECT, INSERT, DELETE ON %s TO %s;\n", s.table, r)
	fmt.Fprintf(&b, "GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO %s;\n", s.attempts, r)
	fmt.Fprintf(&b, "GRANT SELECT ON %s TO %s;\n", s.versions, r)
	if s.cfg.Layout == LayoutCompact {
		// A consumer name is registered by the first claim that uses it (its identity
		// column's sequence needs no grant of its own).
		fmt.Fprintf(&b, "GRANT SELECT, INSERT ON %s TO %s;\n", s.consumers, r)
	}
	return b.String(), nil
}
