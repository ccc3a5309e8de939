// Package ident validates the names the project prints into SQL: schemas, tables and outbox
// topics (identifiers, always quoted as well with pgx.Identifier) and roles (GRANT
// statements). One rule for every package and command.
package ident

import (
	"fmt"
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// identifierRE accepts unquoted-style PostgreSQL identifiers of at most 63 bytes
// (NAMEDATALEN-1): a letter or underscore, then letters, digits or underscores.
var identifierRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// Validate checks a name the project turns into a PostgreSQL identifier (a schema, a table,
// an outbox topic): a letter or underscore, then letters, digits or underscores, at most
// maxBytes bytes (at most 63, PostgreSQL's NAMEDATALEN-1; a longer name would be truncated
// silently), and not a name GrantObject refuses (the prefix pg_, information_schema). It
// returns nil or an error wrapping inbox.ErrInvalidConfig that names what (e.g. "table
// name"). Names are always quoted as well (pgx.Identifier).
func Validate(what, name string, maxBytes int) error {
	if !identifierRE.MatchString(name) || len(name) > min(maxBytes, 63) {
		return fmt.Errorf("%w: %s %q: want letters, digits and underscores, not starting with a digit, at most %d bytes",
			inbox.ErrInvalidConfig, what, name, min(maxBytes, 63))
	}
	return GrantObject(what, name)
}

// NameError is a role, schema or table name the grants refuse because PostgreSQL would read
// it as something other than the name it spells (see Role and GrantObject).
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
func Role(role string) error {
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
// that GRANT statements and migrations name, beyond Validate's character rule:
// not starting with "pg_" (PostgreSQL reserves the prefix for its system schemas, and
// "pg_temp" is the connection's own temporary schema, so tables created there vanish when the
// connection ends; a table of that prefix is shadowed by pg_catalog's in an unqualified
// query) and not information_schema. Upper-case letters are allowed: the project quotes every
// name it creates and uses, so they never fold. Errors wrap inbox.ErrInvalidConfig; a refused
// name is a *NameError.
func GrantObject(what, name string) error {
	if strings.EqualFold(name, "information_schema") {
		return &NameError{What: what, Name: name, Reason: "PostgreSQL's catalog views live there"}
	}
	if strings.HasPrefix(strings.ToLower(name), "pg_") {
		return &NameError{What: what, Name: name, Reason: "the prefix pg_ is PostgreSQL's own (pg_temp is a temporary schema)"}
	}
	return nil
}
