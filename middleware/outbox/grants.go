package outbox

import (
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/ident"
)

// SequenceName returns the quoted name PostgreSQL gives the sequence of the outbox table's
// BIGSERIAL "offset" column, e.g. "watermill_inbox_outbox_offset_seq": PostgreSQL's
// makeObjectName, which cuts the longer of the table and column names until
// "<table>_offset_seq" fits in 63 bytes. (PostgreSQL adds a digit when that name is already
// taken by another relation; pg_get_serial_sequence gives the real name then.)
func (c Config) SequenceName() string {
	c.setDefaults()
	table, column, label := "watermill_"+c.Topic, "offset", "seq"
	avail := 63 - len(label) - 2
	t, col := len(table), len(column)
	for t+col > avail {
		if t > col {
			t--
		} else {
			col--
		}
	}
	return c.quote(table[:t] + "_" + column[:col] + "_" + label)
}

// GrantSQL returns the GRANT statements that let role write produced messages to the outbox
// of cfg (Outbox.Store, inside the inbox transaction) and run the Relay, with nothing more,
// one statement a line, for the schema's owner to run after InitializeSchema:
//
//   - USAGE on cfg.Schema, when set;
//   - SELECT, INSERT, DELETE on the messages table (the INSERT of Outbox.Store; the relay's
//     polls; the purge of relayed rows, pgstore.PurgeExpired with the topic in Topics, as
//     retention.Purger and `watermill-inbox purge --topic` run it);
//   - USAGE on the messages table's sequence (SequenceName): the BIGSERIAL "offset" column
//     calls nextval, and without it every write fails with SQLSTATE 42501 ("permission
//     denied for sequence");
//   - SELECT, INSERT, UPDATE on the offsets table (the relay's consumer-group row: INSERT ...
//     ON CONFLICT, SELECT ... FOR UPDATE, the ack's upsert).
//
// An invalid topic, schema or role (pgstore.ValidateGrantObject, pgstore.ValidateRole) gives
// an error wrapping inbox.ErrInvalidConfig.
func GrantSQL(cfg Config, role string) (string, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return "", err
	}
	if cfg.Schema != "" {
		if err := ident.GrantObject("schema name", cfg.Schema); err != nil {
			return "", err
		}
	}
	if err := ident.Role(role); err != nil {
		return "", err
	}
	r := pgx.Identifier{role}.Sanitize()
	var b strings.Builder
	fmt.Fprintf(&b, "-- the outbox (topic %s): application role %s\n", cfg.Topic, r)
	if cfg.Schema != "" {
		fmt.Fprintf(&b, "GRANT USAGE ON SCHEMA %s TO %s;\n", pgx.Identifier{cfg.Schema}.Sanitize(), r)
	}
	fmt.Fprintf(&b, "GRANT SELECT, INSERT, DELETE ON %s TO %s;\n", cfg.MessagesTable(), r)
	fmt.Fprintf(&b, "GRANT USAGE ON SEQUENCE %s TO %s;\n", cfg.SequenceName(), r)
	fmt.Fprintf(&b, "GRANT SELECT, INSERT, UPDATE ON %s TO %s;\n", cfg.OffsetsTable(), r)
	return b.String(), nil
}

// MySQLGrantSQL is GrantSQL for MySQL and MariaDB (the outbox of sqlstore's MySQL dialect):
// the GRANT statements that let user 'user'@'%' write produced messages to the outbox table of
// cfg (MySQLMessagesTable, which InitializeMySQLSchema creates) and run the Relay, with nothing
// more, one statement a line: SELECT, INSERT, DELETE on the table (the INSERT of Outbox.Store;
// the relay's polls, SELECT ... FOR UPDATE, which MySQL 8 allows with SELECT and DELETE; the
// DELETE of a relayed row in the relay's transaction). watermill-sql's MySQL queue schema has
// no offsets table and no sequence (the `offset` column is AUTO_INCREMENT). An unqualified cfg
// (no Schema) names the table in the database current when the statements run. An invalid
// topic or schema (Config.Validate) or a user name that is not a letter or underscore followed
// by up to 31 letters, digits or underscores gives an error wrapping inbox.ErrInvalidConfig.
func MySQLGrantSQL(cfg Config, user string) (string, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return "", err
	}
	if err := ident.Validate("user name", user, 32); err != nil {
		return "", err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "-- the outbox (topic %s): application user '%s'@'%%'\n", cfg.Topic, user)
	fmt.Fprintf(&b, "GRANT SELECT, INSERT, DELETE ON %s TO '%s'@'%%';\n", cfg.MySQLMessagesTable(), user)
	return b.String(), nil
}
