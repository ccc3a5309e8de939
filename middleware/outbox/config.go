package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"

	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/ident"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// DefaultTopic is the default outbox topic. With watermill-sql's table naming it is stored in
// the table "watermill_inbox_outbox", and the relay's offsets in "watermill_offsets_inbox_outbox".
const DefaultTopic = "inbox_outbox"

// MaxTopicBytes is the longest accepted outbox topic: PostgreSQL truncates identifiers to 63
// bytes (MySQL refuses names over 64 characters), and the longest table name derived from the
// topic is "watermill_offsets_<topic>".
const MaxTopicBytes = 63 - len("watermill_offsets_")

// Config names the outbox: the watermill-sql topic every produced message is stored in, inside
// a components/forwarder envelope that names its destination topic. The same Config must be
// given to the Outbox (the writer), to the Relay (the reader, in RelayConfig) and to
// InitializeSchema; a zero Config means DefaultTopic in the search_path's schema.
type Config struct {
	// Topic is the watermill-sql topic of the outbox (and the forwarder topic of its
	// envelopes). Default: DefaultTopic. Letters, digits and underscores, not starting with a
	// digit, at most MaxTopicBytes bytes: it is spliced, quoted, into table names.
	Topic string
	// Schema qualifies the outbox tables, e.g. "billing": a PostgreSQL schema, or on MySQL and
	// MariaDB a database. Empty (the default) leaves them unqualified, resolved by the
	// connection's search_path (PostgreSQL) or current database (MySQL), as watermill-sql
	// does.
	Schema string
}

func (c *Config) setDefaults() {
	if c.Topic == "" {
		c.Topic = DefaultTopic
	}
}

// Validate returns an error wrapping inbox.ErrInvalidConfig for an invalid Topic or Schema.
// Constructors call it after filling defaults.
func (c Config) Validate() error {
	if err := ident.Validate("outbox: topic", c.Topic, MaxTopicBytes); err != nil {
		return err
	}
	if c.Schema != "" {
		return ident.Validate("outbox: schema", c.Schema, 63)
	}
	return nil
}

// MessagesTable returns the quoted outbox table name, e.g. "watermill_inbox_outbox" or
// "billing"."watermill_inbox_outbox". Call it on a Config that passed Validate (defaults
// filled); an empty Topic is replaced by DefaultTopic.
func (c Config) MessagesTable() string {
	c.setDefaults()
	return c.quote("watermill_" + c.Topic)
}

// OffsetsTable returns the quoted table in which the relay's watermill-sql subscriber stores
// its acknowledged offset per consumer group, e.g. "watermill_offsets_inbox_outbox".
func (c Config) OffsetsTable() string {
	c.setDefaults()
	return c.quote("watermill_offsets_" + c.Topic)
}

// MySQLMessagesTable returns the outbox table name quoted for MySQL and MariaDB, e.g.
// `watermill_inbox_outbox` or `billing`.`watermill_inbox_outbox`. Call it on a Config that
// passed Validate (its names hold only letters, digits and underscores).
func (c Config) MySQLMessagesTable() string {
	c.setDefaults()
	return c.quoteMySQL("watermill_" + c.Topic)
}

// quoteMySQL quotes a validated name (ident.Validate: no backtick can occur) with backticks,
// qualified by the Schema when set.
func (c Config) quoteMySQL(table string) string {
	if c.Schema == "" {
		return "`" + table + "`"
	}
	return "`" + c.Schema + "`.`" + table + "`"
}

func (c Config) quote(table string) string {
	if c.Schema == "" {
		return pgx.Identifier{table}.Sanitize()
	}
	return pgx.Identifier{c.Schema, table}.Sanitize()
}

// schemaAdapter is watermill-sql's PostgreSQL schema with the table names of c. batchSize is
// the subscriber's SubscribeBatchSize (0: watermill-sql's default, 100).
func (c Config) schemaAdapter(batchSize int) wmsql.DefaultPostgreSQLSchema {
	table := c.MessagesTable()
	return wmsql.DefaultPostgreSQLSchema{
		GenerateMessagesTableName: func(string) string { return table },
		SubscribeBatchSize:        batchSize,
	}
}

// offsetsAdapter is watermill-sql's PostgreSQL offsets adapter with the table names of c.
func (c Config) offsetsAdapter() wmsql.DefaultPostgreSQLOffsetsAdapter {
	table := c.OffsetsTable()
	return wmsql.DefaultPostgreSQLOffsetsAdapter{
		GenerateMessagesOffsetsTableName: func(string) string { return table },
	}
}

// mysqlSchemaAdapter is watermill-sql's MySQL queue schema with the table name of c: an
// AUTO_INCREMENT "offset", uuid, payload JSON (the envelope), metadata JSON, acked, created_at.
// Not its offset-based DefaultMySQLSchema: `offset` is assigned when the INSERT starts, not
// when the row is in the index, so a relay reading "offset > the acked offset" can lock the gap
// before a lower offset's row arrives, ack past it and never read it (measured: the billing
// demo lost 2 receipts of 2000). The queue schema selects every row not acked, whatever its
// offset.
func (c Config) mysqlSchemaAdapter(batchSize int) wmsql.MySQLQueueSchema {
	table := c.MySQLMessagesTable()
	return wmsql.MySQLQueueSchema{
		GenerateMessagesTableName: func(string) string { return table },
		SubscribeBatchSize:        batchSize,
	}
}

// mysqlOffsetsAdapter is watermill-sql's MySQL queue adapter with the table name of c: an
// acked row is deleted, in the relay's transaction, so the table holds only pending rows.
func (c Config) mysqlOffsetsAdapter() wmsql.MySQLQueueOffsetsAdapter {
	table := c.MySQLMessagesTable()
	return wmsql.MySQLQueueOffsetsAdapter{
		DeleteOnAck:               true,
		GenerateMessagesTableName: func(string) string { return table },
	}
}

// schemaQueries are watermill-sql's own schema statements for the outbox topic: the advisory
// transaction lock it takes before creating tables, CREATE TABLE IF NOT EXISTS for the
// messages table, and the same for the offsets table.
func (c Config) schemaQueries() ([]wmsql.Query, error) {
	qs, err := c.schemaAdapter(0).SchemaInitializingQueries(wmsql.SchemaInitializingQueriesParams{Topic: c.Topic})
	if err != nil {
		return nil, fmt.Errorf("outbox: messages table statements: %w", err)
	}
	oqs, err := c.offsetsAdapter().SchemaInitializingQueries(wmsql.OffsetsSchemaInitializingQueriesParams{Topic: c.Topic})
	if err != nil {
		return nil, fmt.Errorf("outbox: offsets table statements: %w", err)
	}
	return append(qs, oqs...), nil
}

// InitializeSchema creates the outbox's two tables when they do not exist (it checks first,
// reading only, and does nothing more when both exist, see CheckSchema): the messages table
// (watermill-sql's: "offset" BIGSERIAL, uuid VARCHAR(36) holding the envelope's own UUID,
// created_at, payload JSON holding the envelope, metadata JSON, transaction_id xid8) and the
// relay's offsets table. Call it before the first delivery that stores messages (the insert
// fails on a missing table, and the inbox rolls the delivery back) and before Relay.Run.
//
// It runs watermill-sql's own statements in one transaction under its advisory transaction
// lock (pg_advisory_xact_lock, the key watermill-sql derives from "watermill"), so several
// processes may call it at once: one creates the tables, the others wait and find them.
// The schema named by cfg.Schema must exist. The pool's search_path decides the schema of an
// unqualified Config. Errors are pgx's, wrapped.
func InitializeSchema(ctx context.Context, pool *pgxpool.Pool, cfg Config) error {
	if pool == nil {
		return fmt.Errorf("%w: outbox: nil pool", inbox.ErrInvalidConfig)
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return err
	}
	// Read-only first: when both tables exist, no DDL right is needed (an application role
	// that cannot create tables may call it at start-up).
	if err := CheckSchema(ctx, pool, cfg); err == nil {
		return nil
	} else if !errors.Is(err, ErrSchemaMissing) {
		return err
	}
	qs, err := cfg.schemaQueries()
	if err != nil {
		return err
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("outbox: initialize schema: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	for _, q := range qs {
		if _, err := tx.Exec(ctx, q.Query, q.Args...); err != nil {
			return fmt.Errorf("outbox: initialize schema: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("outbox: initialize schema: commit: %w", err)
	}
	return nil
}

// SchemaSQL returns the statements InitializeSchema runs, as one script to run in a single
// transaction, for users who apply migrations with their own tool. It does not connect.
func SchemaSQL(cfg Config) (string, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return "", err
	}
	qs, err := cfg.schemaQueries()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for _, q := range qs {
		if len(q.Args) > 0 {
			return "", errors.New("outbox: a schema statement has arguments; use InitializeSchema")
		}
		s := strings.TrimSpace(q.Query)
		b.WriteString(s)
		if !strings.HasSuffix(s, ";") {
			b.WriteString(";")
		}
		b.WriteString("\n")
	}
	return b.String(), nil
}
