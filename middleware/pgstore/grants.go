package pgstore

import (
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/ident"
)

// GrantSQL returns the GRANT statements that let role run the inbox of cfg with nothing more
// (least privilege), one statement a line, for the schema's owner to run after the
// migrations:
//
//   - USAGE on the schema (not CREATE: the role cannot create tables);
//   - SELECT, INSERT, DELETE on the inbox table: the claim (INSERT ... DO
//     NOTHING), the stored payload hash of a duplicate (SELECT), Purge (DELETE);
//   - SELECT, INSERT, UPDATE, DELETE on the attempts table: the durable attempt count
//     (INSERT ... DO UPDATE), dead-letter marks, Replay;
//   - SELECT, INSERT, UPDATE on the duplicate-age histogram: a duplicate's age (INSERT ... DO
//     UPDATE), Stats;
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
	if err := ident.GrantObject("schema name", s.cfg.Schema); err != nil {
		return "", err
	}
	if err := ident.GrantObject("table name", s.cfg.Table); err != nil {
		return "", err
	}
	if err := ident.Role(role); err != nil {
		return "", err
	}
	r := pgx.Identifier{role}.Sanitize()
	var b strings.Builder
	fmt.Fprintf(&b, "-- the inbox %s: application role %s\n", s.table, r)
	fmt.Fprintf(&b, "GRANT USAGE ON SCHEMA %s TO %s;\n", pgx.Identifier{s.cfg.Schema}.Sanitize(), r)
	fmt.Fprintf(&b, "GRANT SELECT, INSERT, DELETE ON %s TO %s;\n", s.table, r)
	fmt.Fprintf(&b, "GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO %s;\n", s.attempts, r)
	fmt.Fprintf(&b, "GRANT SELECT, INSERT, UPDATE ON %s TO %s;\n", s.duplicateAges, r)
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
