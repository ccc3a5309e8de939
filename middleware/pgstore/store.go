// Package pgstore is the PostgreSQL (pgx v5) implementation of the inbox's Store: the claim
// SQL, the embedded migrations and the accessor that hands the inbox transaction to handlers.
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
	"regexp"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	inbox "github.com/watermill-inbox/watermill-inbox/middleware"
)

// Defaults for Config.
const (
	DefaultSchema = "public"
	DefaultTable  = "inbox_processed_messages"
)

// PostgreSQL SQLSTATE codes the store classifies.
const (
	// SQLStateSerializationFailure is serialization_failure (class 40, transaction rollback).
	SQLStateSerializationFailure = "40001"
	// SQLStateDeadlockDetected is deadlock_detected (class 40, transaction rollback).
	SQLStateDeadlockDetected = "40P01"
)

// identifierRE accepts unquoted-style PostgreSQL identifiers of at most 63 bytes
// (NAMEDATALEN-1): a letter or underscore, then letters, digits or underscores.
var identifierRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// Config names the inbox table. Names are validated against identifierRE and always quoted.
type Config struct {
	// Schema holding the table. Default: DefaultSchema. Migrate creates it when missing.
	Schema string
	// Table name. Default: DefaultTable. At most 47 bytes, so that the derived index name
	// "<table>_received_at_idx" fits PostgreSQL's 63-byte identifier limit.
	Table string
}

// Store is the pgx v5 inbox store. It is safe for concurrent use.
type Store struct {
	pool     *pgxpool.Pool
	cfg      Config
	table    string // quoted "schema"."table"
	versions string // quoted "schema".watermill_inbox_migrations
	claimSQL string
}

var _ inbox.Store = (*Store)(nil)

// New returns a Store on pool, or an error wrapping inbox.ErrInvalidConfig for a nil pool or
// an invalid schema or table name. It does not touch the database; call Migrate (or run the
// script from MigrationSQL) before the first claim.
func New(pool *pgxpool.Pool, cfg Config) (*Store, error) {
	if pool == nil {
		return nil, fmt.Errorf("%w: pgstore: nil pool", inbox.ErrInvalidConfig)
	}
	s, err := newNames(cfg)
	if err != nil {
		return nil, err
	}
	s.pool = pool
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
	if !identifierRE.MatchString(cfg.Schema) {
		return nil, fmt.Errorf("%w: pgstore: schema name %q: want letters, digits and underscores, not starting with a digit, at most 63 bytes", inbox.ErrInvalidConfig, cfg.Schema)
	}
	if !identifierRE.MatchString(cfg.Table) || len(cfg.Table) > 47 {
		return nil, fmt.Errorf("%w: pgstore: table name %q: want letters, digits and underscores, not starting with a digit, at most 47 bytes", inbox.ErrInvalidConfig, cfg.Table)
	}
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	return &Store{
		cfg:      cfg,
		table:    table,
		versions: pgx.Identifier{cfg.Schema, migrationsTable}.Sanitize(),
		claimSQL: "INSERT INTO " + table +
			" (message_id, consumer_name, message_type, correlation_id, payload_hash)" +
			" VALUES ($1, $2, $3, $4, $5) ON CONFLICT (message_id, consumer_name) DO NOTHING",
	}, nil
}

// Table returns the quoted, schema-qualified inbox table name, e.g. "public"."inbox_processed_messages".
func (s *Store) Table() string { return s.table }

// Pool returns the pool the store claims on.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

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

// BeginClaim implements inbox.Store. It sends BEGIN and INSERT ... ON CONFLICT
// (message_id, consumer_name) DO NOTHING to PostgreSQL in one pipelined round trip (pgx's
// Batch.BeginTx); zero rows inserted means a duplicate. ON CONFLICT DO NOTHING never raises
// 23505, so a duplicate leaves the transaction usable. A concurrent claim of the same key
// waits on the first transaction's uncommitted row. The transaction holds one pool connection
// until Commit or Rollback. Errors are pgx's, wrapped with the failing step; on error the
// transaction is rolled back and the connection released.
func (s *Store) BeginClaim(ctx context.Context, opts inbox.TxOptions, c inbox.Claim) (inbox.Tx, bool, error) {
	lvl, err := isoLevel(opts.Isolation)
	if err != nil {
		return nil, false, err
	}
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{IsoLevel: lvl})
	b.Queue(s.claimSQL, c.MessageID, c.ConsumerName, nullIfEmpty(c.MessageType), nullIfEmpty(c.CorrelationID), c.PayloadHash)
	br := s.pool.SendBatch(ctx, b)
	tx := br.Tx()
	_, beginErr := br.Exec()
	tag, claimErr := br.Exec()
	closeErr := br.Close()
	switch {
	case beginErr != nil:
		err = fmt.Errorf("begin: %w", beginErr)
	case claimErr != nil:
		err = fmt.Errorf("insert claim: %w", claimErr)
	case closeErr != nil:
		err = fmt.Errorf("claim: %w", closeErr)
	}
	if err != nil {
		// Releases the connection; pgxpool destroys it if it is not back to idle.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), inbox.DefaultFinishTimeout)
		_ = tx.Rollback(rctx)
		cancel()
		return nil, false, err
	}
	return &claimTx{tx: tx}, tag.RowsAffected() == 1, nil
}

// Retryable implements inbox.Store: SQLSTATE 40001 and 40P01.
func (s *Store) Retryable(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == SQLStateSerializationFailure || pgErr.Code == SQLStateDeadlockDetected
	}
	return false
}

func nullIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

type txKey struct{}

// TxFromContext returns the inbox transaction of the delivery whose context is ctx (the
// handler's msg.Context()), and false outside an inbox-wrapped handler. Run the handler's
// business writes on it so they commit or roll back with the claim. Do not Commit or Rollback
// it: the inbox does that after the handler returns.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(pgx.Tx)
	return tx, ok
}

type claimTx struct {
	tx pgx.Tx
}

func (t *claimTx) Context(ctx context.Context) context.Context {
	return context.WithValue(ctx, txKey{}, t.tx)
}

func (t *claimTx) Commit(ctx context.Context) error { return t.tx.Commit(ctx) }

func (t *claimTx) Rollback(ctx context.Context) error {
	if err := t.tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return err
	}
	return nil
}
