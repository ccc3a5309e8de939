package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/ident"
	"github.com/watermill-inbox/watermill-inbox/internal/keyrule"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Dialect is the SQL dialect of the database a Store claims on.
type Dialect int

const (
	// PostgreSQL through pgx's database/sql driver (github.com/jackc/pgx/v5/stdlib, driver
	// name "pgx"), PostgreSQL 13 or later.
	PostgreSQL Dialect = iota + 1
	// MySQL is MariaDB 10.6 or later (tested on 10.11) or MySQL 8 through
	// github.com/go-sql-driver/mysql (driver name "mysql"), InnoDB tables.
	MySQL
)

// String returns "postgres", "mysql", or Dialect(n) for an unknown value.
func (d Dialect) String() string {
	switch d {
	case PostgreSQL:
		return "postgres"
	case MySQL:
		return "mysql"
	}
	return fmt.Sprintf("Dialect(%d)", int(d))
}

// Defaults for Config.
const (
	// DefaultTable is the inbox table's name; the attempts table is "<table>_attempts".
	DefaultTable = "inbox_processed_messages"
	// DefaultPurgeBatchSize is the number of rows Purge deletes per statement when
	// PurgeParams.BatchSize is zero.
	DefaultPurgeBatchSize = 5000
)

// Config names the inbox tables. Names are validated (internal/ident: letters, digits and
// underscores, not starting with a digit) and always quoted.
type Config struct {
	// Dialect is the database's (required): PostgreSQL or MySQL.
	Dialect Dialect
	// Schema holds the tables: a PostgreSQL schema (default "public"; Migrate creates it when
	// missing) or a MySQL database (default: the connection's current database, DATABASE()).
	Schema string
	// Table is the inbox table's name (default DefaultTable), at most 47 bytes so that the
	// derived names ("<table>_attempts", "<table>_received_at_idx") fit both databases'
	// limits (63 bytes on PostgreSQL, 64 characters on MySQL).
	Table string
	// Retention is the table's retention window, reported by RetentionWindow (the inbox's
	// TooOldGuard defaults to it). Zero: none configured.
	Retention inbox.Retention
}

// Store is the inbox's store over database/sql: pass it to inbox.Config.Store. It is safe for
// concurrent use. Each delivery holds one connection of the *sql.DB from claim to commit,
// and a failure or a count needs one more for a moment: set db.SetMaxOpenConns to the
// subscriber's concurrency plus two or more.
type Store struct {
	db       *sql.DB
	cfg      Config
	d        *dialect
	table    string // quoted, qualified
	attempts string // quoted, qualified
	versions string // quoted, qualified migrations table
	lockBase string // the prefix of every key lock's name: dialect, schema and table
	q        queries
	counter  *counter
}

var _ contract.Store = (*Store)(nil)

// New returns a Store on db, or an error wrapping inbox.ErrInvalidConfig for a nil db, an
// unknown dialect, an invalid schema or table name, or a refused retention window (an
// *inbox.RetentionError). It does not touch the database: call Migrate (or run
// MigrationSQL's script) before the first claim. With the MySQL dialect, db must not set
// CLIENT_FOUND_ROWS (go-sql-driver's clientFoundRows=true), under which a duplicate's claim
// reports a row affected; Open refuses it.
func New(db *sql.DB, cfg Config) (*Store, error) {
	if db == nil {
		return nil, fmt.Errorf("%w: sqlstore: nil db", inbox.ErrInvalidConfig)
	}
	if cfg.Retention != (inbox.Retention{}) {
		if err := cfg.Retention.Validate(); err != nil {
			return nil, err
		}
		cfg.Retention = cfg.Retention.WithDefaults()
	}
	s, err := newNames(cfg)
	if err != nil {
		return nil, err
	}
	s.db = db
	s.counter = &counter{s: s}
	return s, nil
}

// newNames validates cfg and returns a Store without a db, with its quoted names and SQL.
func newNames(cfg Config) (*Store, error) {
	d, ok := dialects[cfg.Dialect]
	if !ok {
		return nil, fmt.Errorf("%w: sqlstore: unknown dialect %d (want sqlstore.PostgreSQL or sqlstore.MySQL)", inbox.ErrInvalidConfig, int(cfg.Dialect))
	}
	if cfg.Table == "" {
		cfg.Table = DefaultTable
	}
	if cfg.Schema == "" && cfg.Dialect == PostgreSQL {
		cfg.Schema = "public"
	}
	if cfg.Schema != "" {
		if err := ident.Validate("schema name", cfg.Schema, 63); err != nil {
			return nil, err
		}
	}
	if err := ident.Validate("table name", cfg.Table, 47); err != nil {
		return nil, err
	}
	s := &Store{cfg: cfg, d: d}
	s.table = d.qualify(cfg.Schema, cfg.Table)
	s.attempts = d.qualify(cfg.Schema, cfg.Table+"_attempts")
	s.versions = d.qualify(cfg.Schema, versionsTable)
	s.lockBase = "watermill-inbox\x1f" + cfg.Schema + "\x1f" + cfg.Table
	s.q = newQueries(d, queryNames{Table: s.table, Attempts: s.attempts})
	return s, nil
}

// DB returns the *sql.DB the store claims on.
func (s *Store) DB() *sql.DB { return s.db }

// Config returns the configuration with defaults filled.
func (s *Store) Config() Config { return s.cfg }

// Table returns the quoted, qualified inbox table name ("public"."inbox_processed_messages"
// on PostgreSQL; `inbox_processed_messages` or `db`.`inbox_processed_messages` on MySQL).
func (s *Store) Table() string { return s.table }

// AttemptsTable returns the quoted, qualified attempts table name.
func (s *Store) AttemptsTable() string { return s.attempts }

// NeedsProducerTime is false: the store is not partitioned.
func (s *Store) NeedsProducerTime() bool { return false }

// RetentionWindow returns Config.Retention's window, zero when none is configured.
func (s *Store) RetentionWindow() time.Duration {
	if s.cfg.Retention == (inbox.Retention{}) {
		return 0
	}
	return s.cfg.Retention.Window
}

// Check reports whether the store can claim d: the message ID must be what keyrule accepts
// (1 to 512 bytes of valid UTF-8 without NUL, not blank) and the consumer name at most 128
// bytes of valid UTF-8: the key columns' sizes (VARBINARY(512), VARBINARY(128) on MySQL).
// Errors wrap ErrKeyNotStorable and inbox.ErrInvalidKey and never contain the key.
func (s *Store) Check(d contract.Delivery) error {
	if p := keyrule.Problem(d.Key.MessageID); p != "" {
		return fmt.Errorf("%w: message ID %s", ErrKeyNotStorable, p)
	}
	if n := len(d.Key.ConsumerName); n == 0 || n > keyrule.MaxConsumerNameBytes || !utf8.ValidString(d.Key.ConsumerName) ||
		strings.IndexByte(d.Key.ConsumerName, 0) >= 0 {
		return fmt.Errorf("%w: consumer name: want 1 to %d bytes of UTF-8 without NUL", ErrKeyNotStorable, keyrule.MaxConsumerNameBytes)
	}
	return nil
}

// The errors of package sqlstore. A database error is the driver's (*pgconn.PgError,
// *mysql.MySQLError), wrapped with the failing step.
var (
	// ErrKeyNotStorable: a key the inbox columns cannot hold as it is (too long, invalid
	// UTF-8, NUL, empty). It wraps inbox.ErrInvalidKey: the inbox dead-letters such a message
	// (or nacks it under the invalid-key brake), never truncates or merges it.
	ErrKeyNotStorable = fmt.Errorf("%w: sqlstore: key not storable", inbox.ErrInvalidKey)
	// ErrClaimInFlight is wrapped by a claim's error when its key stayed held by another
	// delivery until the claim's context ended. The claim held no connection while it waited
	// and counted nothing. It also wraps the context's error.
	ErrClaimInFlight = errors.New("sqlstore: the key is claimed by a delivery in flight")
	// ErrBadDSN is wrapped (with inbox.ErrInvalidConfig) by Open's error for a data source
	// name the driver cannot parse, or one with a setting the store cannot work with.
	ErrBadDSN = fmt.Errorf("%w: sqlstore: invalid data source name", inbox.ErrInvalidConfig)
	// ErrUnreachable is wrapped by Open's error when the database does not answer (down, a
	// closed port, a wrong host) or refuses the login; the driver's error is wrapped too.
	ErrUnreachable = errors.New("sqlstore: the database is unreachable")
)

// maxErrorBytes bounds the last_error and dead_letter_reason values, in bytes.
const maxErrorBytes = 1024

// MarkDeadLettered records that k was published to the dead-letter topic with reason.
func (s *Store) MarkDeadLettered(ctx context.Context, k contract.Key, reason string) error {
	a := keyArgs(k)
	a.reason = truncateUTF8(reason, maxErrorBytes)
	if _, err := s.q.markDeadLettered.exec(ctx, s.db, a); err != nil {
		return fmt.Errorf("sqlstore: mark dead-lettered: %w", err)
	}
	return nil
}

// Replay deletes k's dead-lettered record, so the message's next delivery runs the handler
// again, and reports whether there was one.
func (s *Store) Replay(ctx context.Context, k contract.Key) (bool, error) {
	res, err := s.q.replay.exec(ctx, s.db, keyArgs(k))
	if err != nil {
		return false, fmt.Errorf("sqlstore: replay: %w", err)
	}
	n, err := res.RowsAffected()
	return n > 0, err
}

// PurgeParams are the inputs of Store.Purge.
type PurgeParams struct {
	// Before: rows of processed messages received before this are deleted.
	Before time.Time
	// BatchSize bounds the rows deleted per statement; zero means DefaultPurgeBatchSize.
	BatchSize int
	// ConsumerName, when non-empty, limits the purge to one consumer.
	ConsumerName string
}

// PurgeResult reports what Store.Purge did.
type PurgeResult struct {
	// Deleted is the number of inbox rows deleted.
	Deleted int64
	// Batches is the number of delete statements run.
	Batches int
}

// Purge deletes processed rows received before p.Before, p.BatchSize rows per statement
// (each its own transaction; MySQL: DELETE ... ORDER BY received_at LIMIT n), oldest first,
// until a batch deletes fewer rows than its size or ctx ends. Purging a row lets a later
// redelivery of its message through as new: Before must be older than the longest
// redelivery the consumer supports (inbox.Retention). On MySQL, whose DATETIME has no time
// zone, the cut is p.Before's age (time.Since) taken back from the server's clock in the
// session's time zone, as received_at was written.
func (s *Store) Purge(ctx context.Context, p PurgeParams) (PurgeResult, error) {
	var res PurgeResult
	size := p.BatchSize
	if size <= 0 {
		size = DefaultPurgeBatchSize
	}
	a := &queryArgs{before: p.Before.UTC(), consumerName: nullIfEmpty(p.ConsumerName), batchSize: int64(size),
		ageMicros: max(time.Since(p.Before).Microseconds(), 0)}
	for {
		r, err := s.q.purge.exec(ctx, s.db, a)
		if err != nil {
			return res, fmt.Errorf("sqlstore: purge: %w", err)
		}
		n, err := r.RowsAffected()
		if err != nil {
			return res, fmt.Errorf("sqlstore: purge: %w", err)
		}
		res.Batches++
		res.Deleted += n
		if n < int64(size) {
			return res, nil
		}
	}
}

// MySQL and MariaDB error numbers the store classifies (server error reference).
const (
	mysqlLockWaitTimeout      = 1205 // ER_LOCK_WAIT_TIMEOUT: the statement (not the transaction) rolled back
	mysqlDeadlock             = 1213 // ER_LOCK_DEADLOCK: the transaction rolled back
	mysqlRecordChanged        = 1020 // ER_CHECKREAD: MariaDB innodb_snapshot_isolation write conflict
	mysqlPluginRollback       = 3101 // ER_TRANSACTION_ROLLBACK_DURING_COMMIT: Group Replication certification
	mysqlDBAccessDenied       = 1044 // ER_DBACCESS_DENIED_ERROR
	mysqlAccessDenied         = 1045 // ER_ACCESS_DENIED_ERROR: login refused
	mysqlBadDB                = 1049 // ER_BAD_DB_ERROR: unknown database
	mysqlBadField             = 1054 // ER_BAD_FIELD_ERROR: unknown column
	mysqlTableAccessDenied    = 1142 // ER_TABLEACCESS_DENIED_ERROR
	mysqlColumnAccessDenied   = 1143 // ER_COLUMNACCESS_DENIED_ERROR
	mysqlNoSuchTable          = 1146 // ER_NO_SUCH_TABLE
	mysqlSpecificAccessDenied = 1227 // ER_SPECIFIC_ACCESS_DENIED_ERROR
	mysqlProcAccessDenied     = 1370 // ER_PROCACCESS_DENIED_ERROR
)

// Classify says what err is, for the inbox. contract.Retryable: PostgreSQL SQLSTATE 40001
// and 40P01; MySQL 1213 (deadlock: InnoDB rolled the transaction back), 1205 (lock wait
// timeout: only the statement rolled back, so the inbox's rollback before the retry is what
// ends the transaction), 1020 (MariaDB's snapshot-isolation write conflict) and 3101 (a
// rollback during commit by Group Replication). contract.ConfigFault: PostgreSQL SQLSTATE
// classes 42 and 28, 3D000, 3F000; MySQL 1044, 1045, 1049, 1054, 1142, 1143, 1146, 1227,
// 1370 (a missing privilege, database, table or column, a refused login). Anything else is
// contract.Other.
func (s *Store) Classify(err error) contract.Class {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case pgErr.Code == "40001", pgErr.Code == "40P01":
			return contract.Retryable
		case strings.HasPrefix(pgErr.Code, "42"), strings.HasPrefix(pgErr.Code, "28"), pgErr.Code == "3D000", pgErr.Code == "3F000":
			return contract.ConfigFault
		}
		return contract.Other
	}
	var myErr *mysql.MySQLError
	if errors.As(err, &myErr) {
		switch myErr.Number {
		case mysqlDeadlock, mysqlLockWaitTimeout, mysqlRecordChanged, mysqlPluginRollback:
			return contract.Retryable
		case mysqlDBAccessDenied, mysqlAccessDenied, mysqlBadDB, mysqlBadField, mysqlTableAccessDenied,
			mysqlColumnAccessDenied, mysqlNoSuchTable, mysqlSpecificAccessDenied, mysqlProcAccessDenied:
			return contract.ConfigFault
		}
	}
	return contract.Other
}

// serverError reports whether err is an error the server answered with.
func serverError(err error) bool {
	var pgErr *pgconn.PgError
	var myErr *mysql.MySQLError
	return errors.As(err, &pgErr) || errors.As(err, &myErr) || errors.Is(err, pgx.ErrTxCommitRollback)
}

// Open opens a *sql.DB for dialect on dsn and pings it within ctx. The dsn is pgx's (a URL
// or keyword/value string) for PostgreSQL, go-sql-driver's ("user:pass@tcp(host:3306)/db")
// for MySQL. Errors: ErrBadDSN (with inbox.ErrInvalidConfig) when it does not parse or, for
// MySQL, sets clientFoundRows=true or multiStatements=true; ErrUnreachable with the driver's
// error when the ping fails (a MySQL 1045 refused login is also a contract.ConfigFault for
// Classify). No error contains the password.
func Open(ctx context.Context, dialect Dialect, dsn string) (*sql.DB, error) {
	var driver string
	switch dialect {
	case PostgreSQL:
		if _, err := pgx.ParseConfig(dsn); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadDSN, err) // pgx redacts the password
		}
		driver = "pgx"
	case MySQL:
		c, err := mysql.ParseDSN(dsn)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadDSN, err)
		}
		if c.ClientFoundRows || c.MultiStatements {
			return nil, fmt.Errorf("%w: clientFoundRows and multiStatements must be off", ErrBadDSN)
		}
		driver = "mysql"
	default:
		return nil, fmt.Errorf("%w: sqlstore: unknown dialect %d", inbox.ErrInvalidConfig, int(dialect))
	}
	db, err := sql.Open(driver, dsn)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadDSN, err)
	}
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	return db, nil
}

// truncateUTF8 cuts s to at most n bytes without splitting a UTF-8 sequence, and replaces
// invalid UTF-8 and NUL.
func truncateUTF8(s string, n int) string {
	s = strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", ""), "\uFFFD")
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

func nullIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}
