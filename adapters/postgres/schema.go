package postgres

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/ident"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// ErrTopicNotReady is wrapped by the error of a NoDDL broker's Publish and Subscribe (and of
// CheckTopic) when a topic's table is missing or the role lacks a privilege on it: a
// configuration fault that no retry cures. The error names the table or the privilege and the
// command that fixes it.
var ErrTopicNotReady = errors.New("postgres broker: topic tables not ready")

// TopicTables are the quoted names of one topic's objects: watermill-sql's messages table
// ("watermill_<topic>"), the sequence of its BIGSERIAL "offset" column, and the offsets table
// ("watermill_offsets_<topic>"), in Config.Schema when set (else where the search_path finds
// them).
type TopicTables struct {
	Messages, Sequence, Offsets string
}

// Tables returns the names of topic's objects, or an error wrapping inbox.ErrInvalidConfig
// for a topic watermill-sql refuses (characters other than A-Z a-z 0-9 - $ : . _).
func (c Config) Tables(topic string) (TopicTables, error) {
	if topic == "" || strings.ContainsFunc(topic, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-$:._", r))
	}) {
		return TopicTables{}, fmt.Errorf("%w: postgres broker: topic %q: want A-Z, a-z, 0-9, - $ : . _", inbox.ErrInvalidConfig, topic)
	}
	return TopicTables{
		Messages: c.quote("watermill_" + topic),
		Sequence: c.quote(serialSequence("watermill_"+topic, "offset")),
		Offsets:  c.quote("watermill_offsets_" + topic),
	}, nil
}

func (c Config) quote(name string) string {
	if c.Schema == "" {
		return pgx.Identifier{name}.Sanitize()
	}
	return pgx.Identifier{c.Schema, name}.Sanitize()
}

// serialSequence is the name PostgreSQL gives a serial column's sequence: makeObjectName cuts
// the longer of the table and column names until "<table>_<column>_seq" fits in 63 bytes.
// (PostgreSQL adds a digit when the name is taken by another relation already.)
func serialSequence(table, column string) string {
	avail := 63 - len("seq") - 2
	t, col := len(table), len(column)
	for t+col > avail {
		if t > col {
			t--
		} else {
			col--
		}
	}
	return table[:t] + "_" + column[:col] + "_seq"
}

// schemaAdapter is watermill-sql's PostgreSQL schema for the broker: BYTEA payloads, the table
// names of Tables.
func (c Config) schemaAdapter() sql.DefaultPostgreSQLSchema {
	return sql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: func(topic string) string { t, _ := c.Tables(topic); return t.Messages },
		GeneratePayloadType:       func(string) string { return "BYTEA" },
		SubscribeBatchSize:        c.BatchSize,
	}
}

func (c Config) offsetsAdapter() sql.DefaultPostgreSQLOffsetsAdapter {
	return sql.DefaultPostgreSQLOffsetsAdapter{
		GenerateMessagesOffsetsTableName: func(topic string) string { t, _ := c.Tables(topic); return t.Offsets },
	}
}

// SchemaSQL returns the statements that create the tables of topics, one a line, in one
// transaction (BEGIN; ... COMMIT;): the ones watermill-sql runs itself when NoDDL is off (an
// advisory transaction lock, then CREATE TABLE IF NOT EXISTS for each messages and offsets
// table), for the schema's owner to run before a
// NoDDL broker starts (`watermill-inbox migrate --broker-topics ... --print`). Errors wrap
// inbox.ErrInvalidConfig for an invalid topic or no topic.
func SchemaSQL(cfg Config, topics ...string) (string, error) {
	qs, err := schemaQueries(cfg, topics)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	b.WriteString("BEGIN;\n")
	for _, q := range qs {
		b.WriteString(strings.Join(strings.Fields(q), " "))
		if !strings.HasSuffix(q, ";") {
			b.WriteString(";")
		}
		b.WriteString("\n")
	}
	b.WriteString("COMMIT;\n")
	return b.String(), nil
}

func schemaQueries(cfg Config, topics []string) ([]string, error) {
	if len(topics) == 0 {
		return nil, fmt.Errorf("%w: postgres broker: no topic", inbox.ErrInvalidConfig)
	}
	var out []string
	for i, topic := range topics {
		if _, err := cfg.Tables(topic); err != nil {
			return nil, err
		}
		qs, err := cfg.schemaAdapter().SchemaInitializingQueries(sql.SchemaInitializingQueriesParams{Topic: topic})
		if err != nil {
			return nil, fmt.Errorf("postgres broker: topic %q: %w", topic, err)
		}
		oqs, err := cfg.offsetsAdapter().SchemaInitializingQueries(sql.OffsetsSchemaInitializingQueriesParams{Topic: topic})
		if err != nil {
			return nil, fmt.Errorf("postgres broker: topic %q: %w", topic, err)
		}
		for j, q := range append(qs, oqs...) {
			if len(q.Args) > 0 {
				return nil, fmt.Errorf("postgres broker: topic %q: a schema statement has arguments", topic)
			}
			if i > 0 && j == 0 && strings.Contains(q.Query, "pg_advisory_xact_lock") {
				continue // one lock for the whole script
			}
			out = append(out, strings.TrimSpace(q.Query))
		}
	}
	return out, nil
}

// Migrate creates the tables of topics (SchemaSQL's statements) in one transaction, as the
// schema's owner would: it is idempotent. Errors wrap inbox.ErrInvalidConfig for an invalid
// topic, or are the database's, wrapped.
func Migrate(ctx context.Context, pool *pgxpool.Pool, cfg Config, topics ...string) error {
	qs, err := schemaQueries(cfg, topics)
	if err != nil {
		return err
	}
	if pool == nil {
		return fmt.Errorf("%w: postgres broker: nil pool", inbox.ErrInvalidConfig)
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, q := range qs {
			if _, err := tx.Exec(ctx, q); err != nil {
				return fmt.Errorf("postgres broker: create topic tables: %w", err)
			}
		}
		return nil
	})
}

// GrantSQL returns the GRANT statements that let role publish to and subscribe to topics with
// nothing more (no CREATE), one a line, for the schema's owner to run after Migrate
// (`watermill-inbox grants --broker-topics ...`):
//
//   - USAGE on cfg.Schema, when set;
//   - SELECT, INSERT on each messages table (publish; the subscriber's polls);
//   - USAGE on its sequence: the BIGSERIAL "offset" column calls nextval (SQLSTATE 42501,
//     "permission denied for sequence", without it);
//   - SELECT, INSERT, UPDATE on each offsets table (the consumer group's row: INSERT ... ON
//     CONFLICT when subscribing, SELECT ... FOR UPDATE on each poll, the ack's upsert).
//
// Errors wrap inbox.ErrInvalidConfig for an invalid topic, schema or role.
func GrantSQL(cfg Config, role string, topics ...string) (string, error) {
	if err := ident.Role(role); err != nil {
		return "", err
	}
	if len(topics) == 0 {
		return "", fmt.Errorf("%w: postgres broker: no topic", inbox.ErrInvalidConfig)
	}
	r := pgx.Identifier{role}.Sanitize()
	var b strings.Builder
	fmt.Fprintf(&b, "-- the postgres broker's topics (%s): application role %s\n", strings.Join(topics, ", "), r)
	if cfg.Schema != "" {
		fmt.Fprintf(&b, "GRANT USAGE ON SCHEMA %s TO %s;\n", pgx.Identifier{cfg.Schema}.Sanitize(), r)
	}
	for _, topic := range topics {
		t, err := cfg.Tables(topic)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(&b, "GRANT SELECT, INSERT ON %s TO %s;\n", t.Messages, r)
		fmt.Fprintf(&b, "GRANT USAGE ON SEQUENCE %s TO %s;\n", t.Sequence, r)
		fmt.Fprintf(&b, "GRANT SELECT, INSERT, UPDATE ON %s TO %s;\n", t.Offsets, r)
	}
	return b.String(), nil
}

// What a NoDDL broker checks before it uses a topic.
const (
	forPublish   = "publish"
	forSubscribe = "subscribe"
)

// CheckTopic reports whether the current role can publish to topic (use "publish") or
// subscribe to it ("subscribe") without DDL: the schema is usable, the tables exist, and the
// role holds the privileges GrantSQL grants for that use. It reads the catalog only. It
// returns nil, an error wrapping ErrTopicNotReady and inbox.ErrInvalidConfig that names the
// missing table or privilege and the command that fixes it, or the database's error, wrapped.
func CheckTopic(ctx context.Context, pool *pgxpool.Pool, cfg Config, topic, use string) error {
	t, err := cfg.Tables(topic)
	if err != nil {
		return err
	}
	fault := func(format string, args ...any) error {
		return fmt.Errorf("%w: %w: topic %q: %s", ErrTopicNotReady, inbox.ErrInvalidConfig, topic, fmt.Sprintf(format, args...))
	}
	flags := "--broker-topics " + topic
	if cfg.Schema != "" {
		flags += " --broker-schema " + cfg.Schema
	}
	migrate := fmt.Sprintf("run `watermill-inbox migrate %s` as the schema's owner", flags)
	grants := fmt.Sprintf("run what `watermill-inbox grants --role <role> %s` prints, as the owner", flags)
	var role string
	var schemaExists, schemaUsage bool
	if err := pool.QueryRow(ctx, `SELECT current_user, count(*) > 0, coalesce(bool_or(has_schema_privilege(oid, 'USAGE')), false)
		FROM pg_namespace WHERE nspname = $1`, cfg.Schema).Scan(&role, &schemaExists, &schemaUsage); err != nil {
		return fmt.Errorf("postgres broker: check topic %q: %w", topic, err)
	}
	r := pgx.Identifier{role}.Sanitize()
	if cfg.Schema != "" {
		switch {
		case !schemaExists:
			return fault("schema %s does not exist (%s)", pgx.Identifier{cfg.Schema}.Sanitize(), migrate)
		case !schemaUsage:
			return fault("role %s lacks USAGE on schema %s (%s)", r, pgx.Identifier{cfg.Schema}.Sanitize(), grants)
		}
	}
	// NULL (nil) where a table is missing: has_*_privilege of a NULL oid is NULL.
	var messages, offsets bool
	var msgSelect, msgInsert, seqOK, offSelect, offInsert, offUpdate *bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL,
			has_table_privilege(to_regclass($1), 'SELECT'), has_table_privilege(to_regclass($1), 'INSERT'),
			CASE WHEN to_regclass($1) IS NOT NULL
				THEN has_sequence_privilege(to_regclass(pg_get_serial_sequence($1, 'offset')), 'USAGE') END,
			has_table_privilege(to_regclass($2), 'SELECT'), has_table_privilege(to_regclass($2), 'INSERT'),
			has_table_privilege(to_regclass($2), 'UPDATE')`,
		t.Messages, t.Offsets).Scan(&messages, &offsets, &msgSelect, &msgInsert, &seqOK, &offSelect, &offInsert, &offUpdate); err != nil {
		return fmt.Errorf("postgres broker: check topic %q: %w", topic, err)
	}
	missing := func(p *bool) bool { return p == nil || !*p }
	switch {
	case !messages:
		return fault("table %s does not exist, or role %s cannot see its schema (%s)", t.Messages, r, migrate)
	case use == forPublish && missing(msgInsert):
		return fault("role %s lacks INSERT on %s (%s)", r, t.Messages, grants)
	case use == forPublish && missing(seqOK):
		return fault("role %s lacks USAGE on the sequence of %s (%s)", r, t.Messages, grants)
	case use == forPublish:
		return nil
	case missing(msgSelect):
		return fault("role %s lacks SELECT on %s (%s)", r, t.Messages, grants)
	case !offsets:
		return fault("table %s does not exist (%s)", t.Offsets, migrate)
	case missing(offSelect) || missing(offInsert) || missing(offUpdate):
		return fault("role %s lacks SELECT, INSERT or UPDATE on %s (%s)", r, t.Offsets, grants)
	}
	return nil
}
