package deferred

import (
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/ident"
	"github.com/watermill-inbox/watermill-inbox/internal/migrate"
)

// GrantSQL returns the GRANT statements that let role run the store-then-process inbox of cfg
// (receipt, workers, reaper, replay, stats, purge) with nothing more (least privilege), one
// statement a line, for the schema's owner to run after the migrations:
//
//   - USAGE on the schema (not CREATE: the role cannot create tables);
//   - SELECT, INSERT, UPDATE, DELETE on the table: the receipt's INSERT ... ON CONFLICT DO
//     NOTHING, the workers' claim and settle (UPDATE ... FOR UPDATE SKIP LOCKED), the reaper,
//     replay, stats, and the purge of done rows (DELETE). The id column is an identity
//     column, whose sequence needs no grant of its own;
//   - SELECT on the version table: CheckSchema, and Migrate when nothing is pending.
//
// LISTEN/NOTIFY, advisory locks and set_config need no privilege. The handler's own tables
// need their own grants; an outbox's are outbox.GrantSQL. Only cfg's Schema and Table are
// read (defaults filled). An invalid schema, table or role gives an error wrapping
// inbox.ErrInvalidConfig. The role must exist.
func GrantSQL(cfg Config, role string) (string, error) {
	cfg.setDefaults()
	if err := ident.Validate("deferred: schema name", cfg.Schema, 63); err != nil {
		return "", err
	}
	if err := ident.Validate("deferred: table name", cfg.Table, 40); err != nil {
		return "", err
	}
	if err := ident.Role(role); err != nil {
		return "", err
	}
	r := pgx.Identifier{role}.Sanitize()
	t := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	var b strings.Builder
	fmt.Fprintf(&b, "-- the store-then-process inbox %s: application role %s\n", t, r)
	fmt.Fprintf(&b, "GRANT USAGE ON SCHEMA %s TO %s;\n", pgx.Identifier{cfg.Schema}.Sanitize(), r)
	fmt.Fprintf(&b, "GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO %s;\n", t, r)
	fmt.Fprintf(&b, "GRANT SELECT ON %s TO %s;\n", pgx.Identifier{cfg.Schema, migrate.VersionsTable}.Sanitize(), r)
	return b.String(), nil
}
