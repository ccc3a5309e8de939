package pgstore

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// NameError is a role, schema or table name the grants refuse because PostgreSQL would read
// it as something other than the name it spells (see ValidateRole and ValidateGrantObject).
// It wraps inbox.ErrInvalidConfig.
type NameError struct {
	What   string // "role name", "schema name", "table name"
	Name   string // the name as given
	Reason string // why, e.g. `PostgreSQL reads "public" as PUBLIC, every role`
}

func (e *NameError) Error() string {
	return fmt.Sprintf("%s: %s %s: %s", inbox.ErrInvalidConfig, e.What, quoteName(e.Name), e.Reason)
}

func (e *NameError) Unwrap() error { return inbox.ErrInvalidConfig }

// quoteName quotes a name for an error (Go escapes, so no control character reaches a log).
func quoteName(s string) string { return fmt.Sprintf("%q", s) }

// reservedRoles are the names a GRANT's role position reads as something else (PostgreSQL's
// RoleSpec in gram.y): "public" is PUBLIC, every role of the cluster, even quoted; "none" is
// reserved; current_user, session_user and current_role name whoever runs the statement
// when unquoted, so a role of that name is read as another role by anyone who types it.
var reservedRoles = map[string]string{
	"public":       "PostgreSQL reads it as PUBLIC, every role of the cluster",
	"none":         "PostgreSQL reserves it",
	"current_user": "unquoted, PostgreSQL reads it as the role running the statement",
	"session_user": "unquoted, PostgreSQL reads it as the role that logged in",
	"current_role": "unquoted, PostgreSQL reads it as the role running the statement",
	"user":         "unquoted, PostgreSQL reads it as CURRENT_USER",
}

// ValidateRole checks a PostgreSQL role name the project prints into GRANT statements: 1 to
// 63 bytes (NAMEDATALEN-1) of valid UTF-8 without control characters, and a name PostgreSQL
// reads as that one role only:
//
//   - not public, none, current_user, session_user, current_role or user (PUBLIC is every
//     role of the cluster, even quoted; the others name whoever runs the statement);
//   - not starting with "pg_", PostgreSQL's prefix for its predefined roles
//     (pg_write_all_data, pg_database_owner, ...): a grant to one reaches all its members;
//   - no ASCII upper-case letter: an unquoted name folds to lower case, so the role created
//     by `CREATE ROLE App` is "app", and "App" would be another role;
//   - no white space and no invisible character (a Unicode format character such as a
//     zero-width space): two names that print alike must not be two roles.
//
// It is always quoted (pgx.Identifier), so any other character is safe. Errors wrap
// inbox.ErrInvalidConfig; a refused name is a *NameError.
func ValidateRole(role string) error {
	if role == "" || len(role) > 63 || !utf8.ValidString(role) || strings.IndexFunc(role, unicode.IsControl) >= 0 {
		return fmt.Errorf("%w: role name %q: want 1 to 63 bytes of UTF-8 without control characters", inbox.ErrInvalidConfig, role)
	}
	if why, ok := reservedRoles[strings.ToLower(role)]; ok {
		return &NameError{What: "role name", Name: role, Reason: why}
	}
	lower := strings.Map(func(r rune) rune { // PostgreSQL's downcase_identifier: ASCII only
		if r >= 'A' && r <= 'Z' {
			return r + 'a' - 'A'
		}
		return r
	}, role)
	switch {
	case strings.HasPrefix(lower, "pg_"):
		return &NameError{What: "role name", Name: role, Reason: "names starting with pg_ are PostgreSQL's predefined roles"}
	case lower != role:
		return &NameError{What: "role name", Name: role, Reason: "unquoted, it folds to " + quoteName(lower) + ": give the name as stored"}
	case strings.IndexFunc(role, func(r rune) bool { return unicode.IsSpace(r) || !unicode.IsGraphic(r) }) >= 0:
		return &NameError{What: "role name", Name: role, Reason: "white space or an invisible character"}
	}
	return nil
}

// ValidateGrantObject checks a schema or table name (what: "schema name" or "table name")
// that GRANT statements and migrations name, beyond ValidateIdentifier's character rule:
// not starting with "pg_" (PostgreSQL reserves the prefix for its system schemas, and
// "pg_temp" is the connection's own temporary schema, so tables created there vanish when the
// connection ends; a table of that prefix is shadowed by pg_catalog's in an unqualified
// query) and not information_schema. Upper-case letters are allowed: the project quotes every
// name it creates and uses, so they never fold. Errors wrap inbox.ErrInvalidConfig; a refused
// name is a *NameError.
func ValidateGrantObject(what, name string) error {
	if strings.EqualFold(name, "information_schema") {
		return &NameError{What: what, Name: name, Reason: "PostgreSQL's catalog views live there"}
	}
	if strings.HasPrefix(strings.ToLower(name), "pg_") {
		return &NameError{What: what, Name: name, Reason: "the prefix pg_ is PostgreSQL's own (pg_temp is a temporary schema)"}
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
// A partitioned table (cfg.Partitioning) needs nothing more for claims and purges: access
// goes through the parent table, whose privileges cover its partitions. Its maintenance
// (EnsurePartitions, DropPartitions, PartitionManager) needs the table's owner, which no
// grant gives (ErrPartitionOwner); the script says so in a comment.
//
// Advisory locks, set_config and the cancel request need no privilege. The handler's own
// tables need their own grants; the outbox's are outbox.GrantSQL. An invalid schema, table
// or role (ValidateIdentifier, ValidateGrantObject, ValidateRole) gives an error wrapping
// inbox.ErrInvalidConfig. The role must exist.
func GrantSQL(cfg Config, role string) (string, error) {
	s, err := newNames(cfg)
	if err != nil {
		return "", err
	}
	if err := ValidateGrantObject("schema name", s.cfg.Schema); err != nil {
		return "", err
	}
	if err := ValidateGrantObject("table name", s.cfg.Table); err != nil {
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
	if s.cfg.Partitioning != nil {
		// Reads and writes go through the parent, whose grants cover its partitions.
		b.WriteString("-- partition maintenance (partitions ensure/drop, PartitionManager) needs the table's owner: no grant allows it\n")
	}
	if s.cfg.Layout == LayoutCompact {
		// A consumer name is registered by the first claim that uses it (its identity
		// column's sequence needs no grant of its own).
		fmt.Fprintf(&b, "GRANT SELECT, INSERT ON %s TO %s;\n", s.consumers, r)
	}
	return b.String(), nil
}
