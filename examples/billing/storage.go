//go:build unix

package main

// The demo's storage seam (-db): the same service, crashes and checks on pgstore (pgx, the
// default), on sqlstore's PostgreSQL dialect (database/sql through pgx's stdlib) or on
// sqlstore's MySQL dialect (MariaDB or MySQL: balances, business tables, inbox and outbox).

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/middleware/sqlstore"
)

// The values of -db.
const (
	// dbPgx: pgstore on a pgxpool.Pool; the handler gets a pgx.Tx (the default).
	dbPgx = "pgx"
	// dbPgSQL: sqlstore's PostgreSQL dialect; the handler gets a *sql.Tx.
	dbPgSQL = "pgsql"
	// dbMySQL: sqlstore's MySQL dialect on MariaDB or MySQL; the handler gets a *sql.Tx.
	dbMySQL = "mysql"

	defaultMySQLDSN = "root@tcp(127.0.0.1:3306)/"
)

var dbKinds = []string{dbPgx, dbPgSQL, dbMySQL}

// mysqlDSN is INBOX_MYSQL_DSN (go-sql-driver's form, no database: the run creates its own),
// or the local MariaDB's root without a password.
func mysqlDSN() string {
	if v := os.Getenv("INBOX_MYSQL_DSN"); v != "" {
		return v
	}
	return defaultMySQLDSN
}

// storage is one process's connection to the run's database: the PostgreSQL schema, or the
// MySQL database, named schema, that holds the inbox, the outbox and the business tables.
type storage struct {
	kind   string
	schema string
	// pool is the PostgreSQL pool (pgx and pgsql; nil on mysql): pgstore's, the postgres
	// broker's and the outbox relay's on PostgreSQL.
	pool *pgxpool.Pool
	// db reaches the same database through database/sql (on PostgreSQL, the pool's
	// connections through pgx's stdlib): sqlstore's, and the orchestrator's queries.
	db *sql.DB
	// store is the inbox's store: pgstore (pg, kind pgx) or sqlstore.
	store inbox.Store
	pg    *pgstore.Store
	// inboxTable and attemptsTable are the store's tables, quoted and qualified.
	inboxTable, attemptsTable string
	// created: the run's schema or database exists (openStorage or setup made it).
	created bool
}

// openStorage connects to the run's database with maxConns connections. appName names the
// PostgreSQL sessions (pg_stat_activity); create makes the MySQL database first (PostgreSQL's
// schema is made by setup, on the open connection).
func openStorage(ctx context.Context, kind, schema, appName string, maxConns int32, create bool) (*storage, error) {
	return openStorageAt(ctx, databaseURL(), kind, schema, appName, maxConns, create)
}

// openStorageAt is openStorage on the PostgreSQL database at url (kind pgx or pgsql), such as a
// shard's (shards.go).
func openStorageAt(ctx context.Context, url, kind, schema, appName string, maxConns int32, create bool) (*storage, error) {
	s := &storage{kind: kind, schema: schema}
	var err error
	if kind == dbMySQL {
		s.db, err = openMySQL(ctx, schema, int(maxConns), create)
	} else {
		s.pool, err = openPool(ctx, url, schema, appName, maxConns)
		if err == nil {
			s.db = stdlib.OpenDBFromPool(s.pool)
		}
	}
	if err != nil {
		return nil, err
	}
	s.created = create && kind == dbMySQL
	switch kind {
	case dbPgx:
		s.pg, err = pgstore.New(s.pool, pgstore.Config{Schema: schema})
		if err == nil {
			s.store, s.inboxTable, s.attemptsTable = s.pg, s.pg.Table(), qualified(schema, pgstore.DefaultTable+"_attempts")
		}
	default:
		dialect := sqlstore.PostgreSQL
		if kind == dbMySQL {
			dialect = sqlstore.MySQL
		}
		var st *sqlstore.Store
		st, err = sqlstore.New(s.db, sqlstore.Config{Dialect: dialect, Schema: schema})
		if err == nil {
			s.store, s.inboxTable, s.attemptsTable = st, st.Table(), st.AttemptsTable()
		}
	}
	if err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// openMySQL opens the run's MySQL database (creating it when create is set) and pings it.
func openMySQL(ctx context.Context, name string, maxConns int, create bool) (*sql.DB, error) {
	cfg, err := mysql.ParseDSN(mysqlDSN())
	if err != nil {
		return nil, fmt.Errorf("parse INBOX_MYSQL_DSN: %w", err) // go-sql-driver's errors carry no password
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if create {
		admin, err := sqlstore.Open(pingCtx, sqlstore.MySQL, cfg.FormatDSN())
		if err != nil {
			return nil, fmt.Errorf("MySQL is not reachable at %s: %w", cfg.Addr, err)
		}
		_, err = admin.ExecContext(ctx, "CREATE DATABASE "+quoteMySQL(name))
		_ = admin.Close()
		if err != nil {
			return nil, fmt.Errorf("create database: %w", err)
		}
	}
	cfg.DBName = name
	db, err := sqlstore.Open(pingCtx, sqlstore.MySQL, cfg.FormatDSN())
	if err != nil {
		return nil, fmt.Errorf("MySQL is not reachable at %s: %w", cfg.Addr, err)
	}
	db.SetMaxOpenConns(maxConns)
	return db, nil
}

func (s *storage) close() {
	if s.db != nil {
		_ = s.db.Close()
	}
	if s.pool != nil {
		s.pool.Close()
	}
}

// quoteMySQL quotes a name the demo made (letters, digits, underscores) for MySQL.
func quoteMySQL(name string) string { return "`" + name + "`" }

// table returns the quoted name of a table of the run.
func (s *storage) table(name string) string {
	if s.kind == dbMySQL {
		return quoteMySQL(s.schema) + "." + quoteMySQL(name)
	}
	return qualified(s.schema, name)
}

var placeholder = regexp.MustCompile(`\$[0-9]+`)

// q returns query, written with PostgreSQL's $1, $2... each used once and in order, with the
// run's placeholders: MySQL's ? on mysql.
func (s *storage) q(query string) string {
	if s.kind != dbMySQL {
		return query
	}
	return placeholder.ReplaceAllString(query, "?")
}

// setup creates the run's schema (PostgreSQL), migrates the inbox, creates the outbox and the
// business tables, and inserts accounts + 1 accounts, the last one frozen.
func (s *storage) setup(ctx context.Context, accounts, rejections, receipts string, n int) error {
	mysqlDB := s.kind == dbMySQL
	if !mysqlDB {
		if _, err := s.pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{s.schema}.Sanitize()); err != nil {
			return fmt.Errorf("create schema: %w", err)
		}
		s.created = true
	}
	migrate := s.migrateSQL
	if s.pg != nil {
		migrate = func(ctx context.Context) error { _, err := s.pg.Migrate(ctx); return err }
	}
	if err := migrate(ctx); err != nil {
		return err
	}
	var err error
	if mysqlDB {
		err = outbox.InitializeMySQLSchema(ctx, s.db, outboxConfig(s.schema))
	} else {
		err = outbox.InitializeSchema(ctx, s.pool, outboxConfig(s.schema))
	}
	if err != nil {
		return err
	}
	ddl := []string{
		"CREATE TABLE " + accounts + " (id bigint PRIMARY KEY, balance bigint NOT NULL DEFAULT 0, frozen boolean NOT NULL DEFAULT false)",
		// One row per handler run that rejected a payment, written outside the inbox
		// transaction, so it stays when the transaction rolls back or the process dies.
		"CREATE TABLE " + rejections + " (id bigserial PRIMARY KEY, message_id text NOT NULL, consumer_run int NOT NULL, at timestamptz NOT NULL DEFAULT now())",
		// One row per receipt counted by the downstream consumer; no unique key, on purpose.
		"CREATE TABLE " + receipts + " (id bigserial PRIMARY KEY, receipt_id text NOT NULL, payment_id text NOT NULL, account_id bigint NOT NULL, amount_cents bigint NOT NULL)",
	}
	if mysqlDB {
		ddl = []string{
			"CREATE TABLE " + accounts + " (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL DEFAULT 0, frozen BOOLEAN NOT NULL DEFAULT FALSE) ENGINE = InnoDB",
			"CREATE TABLE " + rejections + " (id BIGINT AUTO_INCREMENT PRIMARY KEY, message_id VARCHAR(64) NOT NULL, consumer_run INT NOT NULL, at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB",
			"CREATE TABLE " + receipts + " (id BIGINT AUTO_INCREMENT PRIMARY KEY, receipt_id VARCHAR(64) NOT NULL, payment_id VARCHAR(64) NOT NULL, account_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL) ENGINE = InnoDB",
		}
	}
	for _, stmt := range ddl {
		if _, err := s.db.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("create tables: %w", err)
		}
	}
	rows := make([]string, 0, n+1)
	args := make([]any, 0, 2*(n+1))
	for id := 1; id <= n+1; id++ {
		rows = append(rows, fmt.Sprintf("($%d, $%d)", 2*id-1, 2*id))
		args = append(args, id, id > n)
	}
	if _, err := s.db.ExecContext(ctx, s.q("INSERT INTO "+accounts+" (id, frozen) VALUES "+strings.Join(rows, ", ")), args...); err != nil {
		return fmt.Errorf("insert accounts: %w", err)
	}
	return nil
}

// migrateSQL migrates sqlstore's tables.
func (s *storage) migrateSQL(ctx context.Context) error {
	_, err := s.store.(*sqlstore.Store).Migrate(ctx)
	return err
}

// drop deletes the run's schema or database, after a successful run.
func (s *storage) drop(ctx context.Context) error {
	var err error
	if s.kind == dbMySQL {
		_, err = s.db.ExecContext(ctx, "DROP DATABASE "+quoteMySQL(s.schema))
	} else {
		_, err = s.pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{s.schema}.Sanitize()+" CASCADE")
	}
	if err != nil {
		return fmt.Errorf("drop %s: %w", s.schema, err)
	}
	return nil
}

// keptHint says how to drop the run's data kept after a failed run.
func (s *storage) keptHint() string {
	if s.kind == dbMySQL {
		return fmt.Sprintf("database %s for inspection (drop it with: DROP DATABASE %s)", s.schema, quoteMySQL(s.schema))
	}
	return fmt.Sprintf("schema %s for inspection (drop it with: DROP SCHEMA %s CASCADE)", s.schema, s.schema)
}

// relayConfig sets the database the outbox relay reads on cfg: the PostgreSQL pool, or the
// MySQL database.
func (s *storage) relayConfig(cfg outbox.RelayConfig) outbox.RelayConfig {
	if s.kind == dbMySQL {
		cfg.MySQL = s.db
	} else {
		cfg.Pool = s.pool
	}
	return cfg
}

// lockWaiting reports whether a session of the consumer named appName (PostgreSQL's
// application_name; on MySQL any session of the run's database) waits for a row lock in an
// UPDATE (on MySQL: for a second at least).
func (s *storage) lockWaiting(ctx context.Context, appName string) (bool, error) {
	var n int
	var err error
	if s.kind == dbMySQL {
		// An UPDATE by primary key "Updating" for a second or more waits for its row lock
		// (INNODB_TRX does not list every such transaction on MariaDB 10.11).
		err = s.db.QueryRowContext(ctx, `SELECT count(*) FROM information_schema.PROCESSLIST
			WHERE DB = ? AND STATE = 'Updating' AND TIME >= 1 AND INFO LIKE 'UPDATE %'`, s.schema).Scan(&n)
	} else {
		err = s.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock' AND query LIKE 'UPDATE %'`, appName).Scan(&n)
	}
	return n > 0, err
}

// data is the billing service's view of the database: the inbox transactions and the
// autocommit connections of this storage.
func (s *storage) data() billingData {
	if s.kind == dbPgx {
		return pgxData{pool: s.pool}
	}
	return sqlData{db: s.db, s: s}
}

// errClaimInFlight reports a claim that waited for a copy of its message in flight, on either
// store.
func errClaimInFlight(err error) bool {
	return errors.Is(err, pgstore.ErrClaimInFlight) || errors.Is(err, sqlstore.ErrClaimInFlight)
}

// billingData is what the billing service's handlers need from their database: the inbox's
// transaction of a delivery (pgstore's pgx.Tx or sqlstore's *sql.Tx, behind one interface),
// an autocommit write for the rejection log, and the dialect's placeholders.
type billingData interface {
	// tx returns the inbox transaction of the delivery whose context is ctx, false outside
	// an inbox-wrapped handler.
	tx(ctx context.Context) (dataTx, bool)
	// logRejection appends a row for messageID and consumer run to the rejection log (table),
	// outside any inbox transaction, and returns how many rows the message has now.
	logRejection(ctx context.Context, table, messageID string, run int) (int64, error)
}

// dataTx is an inbox transaction. Queries use $1, $2... each once, in order.
type dataTx interface {
	// exec runs a statement and returns the rows it changed.
	exec(ctx context.Context, query string, args ...any) (int64, error)
	// queryRow runs a query of one row; Scan returns errNoRows when it has none.
	queryRow(ctx context.Context, query string, args ...any) rowScanner
}

type rowScanner interface{ Scan(dest ...any) error }

// isNoRows reports a query of one row that found none, from pgx or database/sql.
func isNoRows(err error) bool { return errors.Is(err, pgx.ErrNoRows) || errors.Is(err, sql.ErrNoRows) }

type pgxData struct{ pool *pgxpool.Pool }

func (d pgxData) tx(ctx context.Context) (dataTx, bool) {
	tx, ok := pgstore.TxFromContext(ctx)
	return pgxTx{tx}, ok
}

func (d pgxData) logRejection(ctx context.Context, table, messageID string, run int) (int64, error) {
	var n int64
	err := d.pool.QueryRow(ctx, "WITH logged AS (INSERT INTO "+table+" (message_id, consumer_run) VALUES ($1, $2)) "+
		"SELECT count(*) + 1 FROM "+table+" WHERE message_id = $1", messageID, run).Scan(&n)
	return n, err
}

type pgxTx struct{ tx pgx.Tx }

func (t pgxTx) exec(ctx context.Context, query string, args ...any) (int64, error) {
	tag, err := t.tx.Exec(ctx, query, args...)
	return tag.RowsAffected(), err
}

func (t pgxTx) queryRow(ctx context.Context, query string, args ...any) rowScanner {
	return t.tx.QueryRow(ctx, query, args...)
}

type sqlData struct {
	db *sql.DB
	s  *storage
}

func (d sqlData) tx(ctx context.Context) (dataTx, bool) {
	tx, ok := sqlstore.TxFromContext(ctx)
	return sqlTx{tx: tx, s: d.s}, ok
}

func (d sqlData) logRejection(ctx context.Context, table, messageID string, run int) (int64, error) {
	if _, err := d.db.ExecContext(ctx, d.s.q("INSERT INTO "+table+" (message_id, consumer_run) VALUES ($1, $2)"), messageID, run); err != nil {
		return 0, err
	}
	var n int64
	err := d.db.QueryRowContext(ctx, d.s.q("SELECT count(*) FROM "+table+" WHERE message_id = $1"), messageID).Scan(&n)
	return n, err
}

type sqlTx struct {
	tx *sql.Tx
	s  *storage
}

func (t sqlTx) exec(ctx context.Context, query string, args ...any) (int64, error) {
	res, err := t.tx.ExecContext(ctx, t.s.q(query), args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (t sqlTx) queryRow(ctx context.Context, query string, args ...any) rowScanner {
	return t.tx.QueryRowContext(ctx, t.s.q(query), args...)
}
