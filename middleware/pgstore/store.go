// Package pgstore is the inbox's store on PostgreSQL (pgx v5): the claim and the attempt
// counting (their SQL in queries/*.sql), the embedded migrations, retention, and the accessor
// that hands the inbox transaction to handlers.
//
//	pool, _ := pgxpool.New(ctx, "postgres://localhost/app")
//	store, _ := pgstore.New(pool, pgstore.Config{}) // table public.inbox_processed_messages
//	_, _ = store.Migrate(ctx)
//	ib, _ := inbox.New(inbox.Config{Store: store, ConsumerName: "billing"}, logger)
//	h := router.AddConsumerHandler("billing", "payments", sub, func(msg *message.Message) error {
//		tx, _ := pgstore.TxFromContext(msg.Context())
//		_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + $1 WHERE id = $2", 10, 1)
//		return err
//	})
//	h.AddMiddleware(ib.Middleware)
//
// Each delivery holds one pool connection from claim to commit, so size the pool (pgxpool's
// pool_max_conns) to at least the number of concurrent deliveries the subscriber runs.
package pgstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/ident"
	"github.com/watermill-inbox/watermill-inbox/internal/pgtx"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Defaults for Config.
const (
	DefaultSchema = "public"
	DefaultTable  = "inbox_processed_messages"
	// DefaultPurgeBatchSize is the number of rows Purge deletes per transaction when
	// PurgeParams.BatchSize is zero.
	DefaultPurgeBatchSize = 5000
	// DefaultPurgePause is the pause between two purge batches when PurgeExpiredParams.Pause
	// is zero.
	DefaultPurgePause = 200 * time.Millisecond
	// DiscardBatchSize bounds the dead-lettered records DiscardDeadLetters deletes per
	// transaction.
	DiscardBatchSize = 1000
)

// PostgreSQL SQLSTATE codes the store classifies.
const (
	// sqlStateSerializationFailure is serialization_failure (class 40, transaction rollback).
	sqlStateSerializationFailure = "40001"
	// sqlStateDeadlockDetected is deadlock_detected (class 40, transaction rollback).
	sqlStateDeadlockDetected = "40P01"
)

// Config names the inbox table and holds the PostgreSQL settings of the inbox transaction.
// Names are validated (letters, digits and underscores, not starting with a digit or pg_) and
// always quoted.
type Config struct {
	// Schema holding the table. Default: DefaultSchema. Migrate creates it when missing.
	Schema string
	// Table name. Default: DefaultTable. At most 47 bytes, so that the derived index name
	// "<table>_received_at_idx" fits PostgreSQL's 63-byte identifier limit.
	Table string
	// LockTimeout bounds every lock wait in the inbox transaction (PostgreSQL lock_timeout,
	// set locally; an expired wait fails with SQLSTATE 55P03). A claim never waits on the
	// server for its key: a copy of a message in flight is waited for in process, without a
	// connection, and LockTimeout bounds that wait too. Zero keeps the server's setting.
	LockTimeout time.Duration
	// StatementTimeout bounds every statement in the inbox transaction (PostgreSQL
	// statement_timeout, set locally; SQLSTATE 57014). Zero keeps the server's setting.
	StatementTimeout time.Duration
	// Layout is how rows are stored: LayoutText (default; any key) or LayoutCompact (UUID
	// keys only; about half the bytes per row). See docs/retention.md, "Storage per row".
	Layout Layout
	// Partitioning, when set, turns on partitioned mode (range partitions on the producer
	// time; expired partitions dropped by PartitionManager). Nil: one plain table.
	Partitioning *Partitioning
	// Retention is the table's retention window, used by PurgeExpired (and the background
	// purger and the CLI's purge built on it) and by the inbox's TooOldGuard. A zero value
	// means none is configured: PurgeExpired refuses to run. Any field set: defaults fill
	// the rest, and New refuses a window shorter than MaxRedelivery + Margin with an
	// *inbox.RetentionError (see inbox.Retention and docs/retention.md).
	Retention inbox.Retention
}

// Store is the pgx v5 inbox store: pass it to inbox.Config.Store. It is safe for concurrent
// use.
type Store struct {
	pool     *pgxpool.Pool
	cfg      Config
	table    string // quoted "schema"."table"
	versions string // quoted "schema".watermill_inbox_migrations
	attempts string // quoted "schema"."<table>_attempts"
	// duplicateAges is quoted "schema"."<table>_duplicate_ages": the duplicate-age histogram.
	duplicateAges string
	// consumers is the compact layout's consumers table; registered, the consumer names known
	// to be in it.
	consumers  string
	registered sync.Map
	names      queryNames // what the queries/*.sql templates see
	q          queries    // queries/*.sql, rendered for this store
	counter    *counter   // the group commit of counts (count.go)
}

var _ contract.Store = (*Store)(nil)

// New returns a Store on pool, or an error wrapping inbox.ErrInvalidConfig for a nil pool, an
// invalid schema or table name, a negative timeout, or a refused retention window (an
// *inbox.RetentionError). It does not touch the database; call
// Migrate (or run the script from MigrationSQL) before the first claim.
func New(pool *pgxpool.Pool, cfg Config) (*Store, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: pgstore: nil pool", inbox.ErrInvalidConfig)
	}
	if cfg.LockTimeout < 0 || cfg.StatementTimeout < 0 {
		return nil, fmt.Errorf("%w: pgstore: negative timeout", inbox.ErrInvalidConfig)
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
	s.pool = pool
	s.counter = &counter{s: s}
	return s, nil
}

// newNames validates cfg and returns a Store without a pool, holding the quoted names and SQL.
func newNames(cfg Config) (*Store, error) {
	if cfg.Schema == "" {
		cfg.Schema = DefaultSchema
	}
	if cfg.Table == "" {
		cfg.Table = DefaultTable
	}
	if err := ident.Validate("schema name", cfg.Schema, 63); err != nil {
		return nil, err
	}
	if err := ident.Validate("table name", cfg.Table, 47); err != nil {
		return nil, err
	}
	if err := validateLayout(cfg); err != nil {
		return nil, err
	}
	s := &Store{
		cfg:       cfg,
		table:     pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize(),
		versions:  pgx.Identifier{cfg.Schema, migrationsTable}.Sanitize(),
		attempts:  pgx.Identifier{cfg.Schema, cfg.Table + "_attempts"}.Sanitize(),
		consumers: pgx.Identifier{cfg.Schema, cfg.Table + "_consumers"}.Sanitize(),
		// 47 bytes of table name and this suffix fit the 63 of an identifier.
		duplicateAges: pgx.Identifier{cfg.Schema, cfg.Table + "_duplicate_ages"}.Sanitize(),
	}
	s.names = queryNames{Table: s.table, Attempts: s.attempts, Consumers: s.consumers, DuplicateAges: s.duplicateAges,
		Compact: cfg.Layout == LayoutCompact, Partitioned: cfg.Partitioning != nil}
	s.q = newQueries(s.names)
	return s, nil
}

// Close closes the connection the store opened beside its pool for attempt counting (the
// group commit of counts: it holds one connection more than the pool's MaxConns while counts
// are made, closed after 2 s without one). Call it before closing the pool; a counting claim
// after it fails. It returns nil; the pool is the caller's.
func (s *Store) Close() error {
	s.counter.close()
	return nil
}

// Table returns the quoted, schema-qualified inbox table name, e.g. "public"."inbox_processed_messages".
func (s *Store) Table() string { return s.table }

// AttemptsTable returns the quoted, schema-qualified attempts table name, e.g.
// "public"."inbox_processed_messages_attempts".
func (s *Store) AttemptsTable() string { return s.attempts }

// DuplicateAgesTable returns the quoted, schema-qualified duplicate-age histogram's table name
// (migration 0005), e.g. "public"."inbox_processed_messages_duplicate_ages".
func (s *Store) DuplicateAgesTable() string { return s.duplicateAges }

// Pool returns the pool the store claims on.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Config returns the configuration with defaults filled.
func (s *Store) Config() Config { return s.cfg }

func isoLevel(l sql.IsolationLevel) (pgx.TxIsoLevel, error) {
	switch l {
	case sql.LevelDefault, sql.LevelReadCommitted:
		return pgx.ReadCommitted, nil
	case sql.LevelRepeatableRead:
		return pgx.RepeatableRead, nil
	case sql.LevelSerializable:
		return pgx.Serializable, nil
	}
	return "", fmt.Errorf("%w: pgstore: isolation level %s is not supported", inbox.ErrInvalidConfig, l)
}

// queueTimeouts queues the local lock_timeout and statement_timeout of the current transaction.
func (s *Store) queueTimeouts(b *pgx.Batch) {
	if s.cfg.LockTimeout > 0 {
		b.Queue("select set_config('lock_timeout', $1, true)", millis(s.cfg.LockTimeout))
	}
	if s.cfg.StatementTimeout > 0 {
		b.Queue("select set_config('statement_timeout', $1, true)", millis(s.cfg.StatementTimeout))
	}
}

// millis renders d for lock_timeout and statement_timeout, in whole milliseconds rounded up
// (PostgreSQL reads 0 as "no limit", so a positive sub-millisecond duration becomes 1).
func millis(d time.Duration) string {
	return strconv.FormatInt(int64((d+time.Millisecond-1)/time.Millisecond), 10)
}

// maxErrorBytes bounds the last_error and dead_letter_reason columns, in bytes.
const maxErrorBytes = 1024

// keyArgs are the parameters that name k (and its partition period).
func keyArgs(k inbox.Key, period time.Time) *queryArgs {
	return &queryArgs{messageID: k.MessageID, consumerName: k.ConsumerName, period: period}
}

// MarkDeadLettered records that k was published to the dead-letter topic with reason
// (queries/mark_dead_lettered.sql); the inbox calls it.
func (s *Store) MarkDeadLettered(ctx context.Context, k inbox.Key, reason string) error {
	a := keyArgs(k, time.Time{})
	a.reason = truncateUTF8(reason, maxErrorBytes)
	if _, err := s.pool.Exec(ctx, s.q.markDeadLettered.sql, s.q.markDeadLettered.args(a)...); err != nil {
		return fmt.Errorf("pgstore: mark dead-lettered: %w", err)
	}
	return nil
}

// Replay deletes k's dead-lettered attempt record (queries/replay.sql), so the message's next
// delivery runs the handler again, and reports whether there was one; inbox.Inbox.Replay and
// the CLI's `dead replay` call it.
func (s *Store) Replay(ctx context.Context, k inbox.Key) (bool, error) {
	ct, err := s.pool.Exec(ctx, s.q.replay.sql, s.q.replay.args(keyArgs(k, time.Time{}))...)
	if err != nil {
		return false, fmt.Errorf("pgstore: replay: %w", err)
	}
	return ct.RowsAffected() > 0, nil
}

// PurgeParams are the inputs of Store.Purge.
type PurgeParams struct {
	// Before: rows of processed messages older than this are deleted.
	Before time.Time
	// BatchSize bounds the rows deleted per transaction; zero means DefaultPurgeBatchSize.
	BatchSize int
	// ConsumerName, when non-empty, limits the purge to one consumer.
	ConsumerName string
}

// PurgeResult reports what Store.Purge did.
type PurgeResult struct {
	// Deleted is the number of inbox rows deleted.
	Deleted int64
	// Batches is the number of delete transactions run.
	Batches int
}

// Purge deletes processed rows received before p.Before (in the compact layout: whose whole
// minute of received_minute is before it), p.BatchSize rows per transaction (default
// DefaultPurgeBatchSize), oldest first, until a batch deletes fewer rows than its size or ctx
// ends. It uses the received_at index. Purging a row lets a later redelivery of its message
// through as new: Before must be older than the longest redelivery the consumer supports
// (PurgeExpired checks that against Config.Retention).
func (s *Store) Purge(ctx context.Context, p PurgeParams) (PurgeResult, error) {
	var res PurgeResult
	size := p.BatchSize
	if size <= 0 {
		size = DefaultPurgeBatchSize
	}
	where := " WHERE " + s.receivedBefore("$1") + " AND ($2::text IS NULL OR " + s.consumerMatch("$2") + ") ORDER BY " + s.receivedColumn() + " LIMIT $3"
	q := s.purgeRowsSQL(where)
	for {
		var n int64
		if err := s.pool.QueryRow(ctx, q, p.Before, nullIfEmpty(p.ConsumerName), size).Scan(&n); err != nil {
			return res, fmt.Errorf("pgstore: purge: %w", err)
		}
		res.Batches++
		res.Deleted += n
		if n < int64(size) {
			return res, nil
		}
	}
}

// truncateUTF8 cuts s to at most n bytes without splitting a UTF-8 sequence, and replaces
// invalid UTF-8 and NUL, which PostgreSQL text cannot hold.
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

// Classify says what err is, for the inbox: contract.Retryable for SQLSTATE 40001
// (serialization_failure) and 40P01 (deadlock_detected), after which the whole transaction can
// be retried; contract.ConfigFault for the deployment's faults: SQLSTATE class 42 (syntax
// error or access rule violation: 42501 insufficient_privilege, 42P01 undefined_table, 42703
// undefined_column...), class 28 (invalid authorization), 3D000 and 3F000 (no such database
// or schema).
func (s *Store) Classify(err error) contract.Class {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return contract.Other
	}
	switch {
	case pgErr.Code == sqlStateSerializationFailure, pgErr.Code == sqlStateDeadlockDetected:
		return contract.Retryable
	case strings.HasPrefix(pgErr.Code, "42"), strings.HasPrefix(pgErr.Code, "28"), pgErr.Code == "3D000", pgErr.Code == "3F000":
		return contract.ConfigFault
	}
	return contract.Other
}

// RetentionWindow returns Config.Retention's window, zero when none is configured; the
// inbox's TooOldGuard defaults to it.
func (s *Store) RetentionWindow() time.Duration {
	if s.cfg.Retention == (inbox.Retention{}) {
		return 0
	}
	return s.cfg.Retention.Window
}

func nullIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// TxFromContext returns the inbox transaction of the delivery whose context is ctx (the
// handler's msg.Context()), and false outside an inbox-wrapped handler. Run the handler's
// business writes on it so they commit or roll back with the claim. Do not end it: the inbox
// commits after the handler returns. Its Commit and Rollback return ErrTxOwnedByInbox and
// make the delivery fail (inbox.ErrTxEnded); a nested transaction (Begin, a savepoint) is
// the handler's to end. The store-then-process mode (package deferred) hands its handlers
// their row's transaction the same way.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) { return pgtx.From(ctx) }

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
