package outbox

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// InitializeMySQLSchema is InitializeSchema for MySQL and MariaDB (the outbox of sqlstore's
// MySQL dialect): it creates the outbox table with watermill-sql's MySQL queue schema when
// CheckMySQLSchema finds it missing, and does nothing more when it exists (a user without
// CREATE may call it then). The table, MySQLMessagesTable: `offset` BIGINT AUTO_INCREMENT
// PRIMARY KEY, uuid VARCHAR(36) holding the envelope's own UUID, payload JSON holding the
// envelope, metadata JSON, acked BOOLEAN, created_at TIMESTAMP; the queue needs no offsets
// table. The statement is CREATE TABLE IF NOT EXISTS, which MySQL commits on its own, so
// several processes may call it at once. The database named by cfg.Schema must exist; an
// unqualified Config uses the connection's current database. Errors wrap
// inbox.ErrInvalidConfig (a nil db, an invalid cfg) or are the driver's, wrapped.
func InitializeMySQLSchema(ctx context.Context, db *stdsql.DB, cfg Config) error {
	if err := CheckMySQLSchema(ctx, db, cfg); err == nil || !errors.Is(err, ErrSchemaMissing) {
		return err
	}
	cfg.setDefaults()
	qs, err := cfg.mysqlSchemaAdapter(0).SchemaInitializingQueries(wmsql.SchemaInitializingQueriesParams{Topic: cfg.Topic})
	if err != nil {
		return fmt.Errorf("outbox: messages table statements: %w", err)
	}
	for _, q := range qs {
		if _, err := db.ExecContext(ctx, strings.TrimSuffix(strings.TrimSpace(q.Query), ";"), q.Args...); err != nil {
			return fmt.Errorf("outbox: initialize schema: %w", err)
		}
	}
	return nil
}

// MySQLSchemaSQL returns the statement InitializeMySQLSchema runs (CREATE TABLE IF NOT EXISTS
// of MySQLMessagesTable, watermill-sql's MySQL queue schema), as a script for users who apply
// migrations with their own tool. It does not connect. An invalid cfg gives an error wrapping
// inbox.ErrInvalidConfig.
func MySQLSchemaSQL(cfg Config) (string, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return "", err
	}
	qs, err := cfg.mysqlSchemaAdapter(0).SchemaInitializingQueries(wmsql.SchemaInitializingQueriesParams{Topic: cfg.Topic})
	if err != nil {
		return "", fmt.Errorf("outbox: messages table statements: %w", err)
	}
	var b strings.Builder
	for _, q := range qs {
		if len(q.Args) > 0 {
			return "", errors.New("outbox: a schema statement has arguments; use InitializeMySQLSchema")
		}
		b.WriteString(strings.TrimSuffix(strings.TrimSpace(q.Query), ";"))
		b.WriteString(";\n")
	}
	return b.String(), nil
}

// CheckMySQLSchema is CheckSchema for MySQL and MariaDB: nil when the outbox table of cfg
// exists in cfg.Schema (or the connection's current database), an error wrapping
// ErrSchemaMissing that names it, an error wrapping inbox.ErrInvalidConfig for a nil db or
// an invalid cfg, or the driver's error, wrapped. It reads information_schema only.
func CheckMySQLSchema(ctx context.Context, db *stdsql.DB, cfg Config) error {
	if db == nil {
		return fmt.Errorf("%w: outbox: nil db", inbox.ErrInvalidConfig)
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return err
	}
	var schema any = cfg.Schema
	if cfg.Schema == "" {
		schema = nil // COALESCE: the current database
	}
	var exists bool
	err := db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM information_schema.TABLES
		WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?)`, schema, "watermill_"+cfg.Topic).Scan(&exists)
	if err != nil {
		return fmt.Errorf("outbox: check schema: %w", err)
	}
	if !exists {
		return fmt.Errorf("%w: %s (run InitializeMySQLSchema as a user that may create tables)", ErrSchemaMissing, cfg.MySQLMessagesTable())
	}
	return nil
}

// checkMySQLTables is checkTables on MySQL.
func (r *Relay) checkMySQLTables(ctx context.Context) error {
	t := r.cfg.MySQLMessagesTable()
	rows, err := r.cfg.MySQL.QueryContext(ctx, "SELECT 1 FROM "+t+" LIMIT 0")
	if err != nil {
		return fmt.Errorf("outbox relay: table %s is not usable (call outbox.InitializeMySQLSchema first): %w", t, err)
	}
	return rows.Close()
}

// mysqlRelayDB is relayDB on database/sql for MySQL: the same pipelined commit (relayTx),
// detached statements after the SELECT, and logged row errors. Each poll's transaction runs
// on a connection taken with the subscription's context, and is begun on a context that
// context's end does not cancel: database/sql rolls a transaction back when its BeginTx
// context ends, which would lose the offset of a batch already published at a graceful stop.
type mysqlRelayDB struct {
	db    *stdsql.DB
	relay *Relay
}

func (d mysqlRelayDB) BeginTx(ctx context.Context, opts *stdsql.TxOptions) (wmsql.Tx, error) {
	conn, err := d.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	tx, err := conn.BeginTx(context.WithoutCancel(ctx), opts)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	return &relayTx{tx: sqlPollTx{tx: tx, conn: conn, logger: d.relay.logger}, relay: d.relay, started: time.Now()}, nil
}

func (d mysqlRelayDB) ExecContext(ctx context.Context, query string, args ...any) (wmsql.Result, error) {
	return d.db.ExecContext(ctx, query, args...)
}

func (d mysqlRelayDB) QueryContext(ctx context.Context, query string, args ...any) (wmsql.Rows, error) {
	rows, err := d.db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return sqlRows{rows: rows, logger: d.relay.logger}, nil
}

// sqlPollTx is a relay poll's database/sql transaction and the connection it holds, returned
// to the pool when the transaction ends.
type sqlPollTx struct {
	tx     *stdsql.Tx
	conn   *stdsql.Conn
	logger watermill.LoggerAdapter
}

func (t sqlPollTx) exec(ctx context.Context, query string, args ...any) (wmsql.Result, error) {
	return t.tx.ExecContext(ctx, query, args...)
}

func (t sqlPollTx) query(ctx context.Context, query string, args ...any) (wmsql.Rows, error) {
	rows, err := t.tx.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return sqlRows{rows: rows, logger: t.logger}, nil
}

func (t sqlPollTx) commit(context.Context) error {
	defer func() { _ = t.conn.Close() }()
	return t.tx.Commit()
}

func (t sqlPollTx) rollback(context.Context) error {
	defer func() { _ = t.conn.Close() }()
	err := t.tx.Rollback()
	if errors.Is(err, stdsql.ErrTxDone) {
		return nil // already ended (watermill-sql rolls back after a failed commit too)
	}
	return err
}

// sqlRows adapts *sql.Rows to watermill-sql's Rows and logs the error it would drop
// (Rows.Err: watermill-sql v4.1.2's Rows interface has none).
type sqlRows struct {
	rows   *stdsql.Rows
	logger watermill.LoggerAdapter
}

func (r sqlRows) Next() bool             { return r.rows.Next() }
func (r sqlRows) Scan(dest ...any) error { return r.rows.Scan(dest...) }

func (r sqlRows) Close() error {
	err := r.rows.Err()
	_ = r.rows.Close()
	if err != nil && !errors.Is(err, context.Canceled) {
		r.logger.Error("Outbox poll failed while reading rows; watermill-sql treats it as an empty poll and polls again", err, nil)
	}
	return nil
}

// mysqlLag is Lag on MySQL: the queue holds only rows not relayed yet (relayed rows are
// deleted), so Pending is its row count and OffsetGap equals Pending; OldestAge comes from
// created_at, a TIMESTAMP: whole seconds.
func (r *Relay) mysqlLag(ctx context.Context) (RelayLag, error) {
	q := "SELECT count(*), COALESCE(TIMESTAMPDIFF(MICROSECOND, min(created_at), CURRENT_TIMESTAMP(6)), 0) FROM " +
		r.cfg.MySQLMessagesTable() + " WHERE acked = FALSE"
	var lag RelayLag
	var micros int64
	if err := r.cfg.MySQL.QueryRowContext(ctx, q).Scan(&lag.Pending, &micros); err != nil {
		return RelayLag{}, fmt.Errorf("outbox relay: reading the lag of the MySQL outbox: %w", err)
	}
	lag.OffsetGap = lag.Pending
	if micros > 0 && lag.Pending > 0 {
		lag.OldestAge = time.Duration(micros) * time.Microsecond
	}
	return lag, nil
}
