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
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
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
	attempts string // quoted "schema"."<table>_attempts"
	claimSQL string
	// attemptSQL counts one attempt and returns (attempts, dead-lettered).
	attemptSQL string
	// clearAttemptsSQL deletes a key's attempt record unless it is dead-lettered.
	clearAttemptsSQL string
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
	attempts := pgx.Identifier{cfg.Schema, cfg.Table + "_attempts"}.Sanitize()
	return &Store{
		cfg:      cfg,
		table:    table,
		versions: pgx.Identifier{cfg.Schema, migrationsTable}.Sanitize(),
		attempts: attempts,
		claimSQL: "INSERT INTO " + table +
			" (message_id, consumer_name, message_type, correlation_id, payload_hash)" +
			" VALUES ($1, $2, $3, $4, $5) ON CONFLICT (message_id, consumer_name) DO NOTHING",
		attemptSQL: "INSERT INTO " + attempts + " AS a (message_id, consumer_name) VALUES ($1, $2)" +
			" ON CONFLICT (message_id, consumer_name) DO UPDATE SET attempts = a.attempts + 1, last_attempt_at = now()" +
			" RETURNING a.attempts, a.dead_lettered_at IS NOT NULL",
		clearAttemptsSQL: "DELETE FROM " + attempts +
			" WHERE message_id = $1 AND consumer_name = $2 AND dead_lettered_at IS NULL",
	}, nil
}

// Table returns the quoted, schema-qualified inbox table name, e.g. "public"."inbox_processed_messages".
func (s *Store) Table() string { return s.table }

// AttemptsTable returns the quoted, schema-qualified attempts table name, e.g.
// "public"."inbox_processed_messages_attempts".
func (s *Store) AttemptsTable() string { return s.attempts }

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

// BeginClaim implements inbox.Store. Everything before the handler travels in one pipelined
// round trip (pgx's Batch.BeginTx):
//
//   - with CountAttempt: BEGIN; SET LOCAL synchronous_commit TO OFF; the attempt upsert
//     (INSERT ... ON CONFLICT DO UPDATE SET attempts = attempts + 1 RETURNING ...); COMMIT;
//   - BEGIN ISOLATION LEVEL ...; lock_timeout and statement_timeout (set_config, local);
//   - INSERT ... ON CONFLICT (message_id, consumer_name) DO NOTHING: zero rows means a
//     duplicate. ON CONFLICT DO NOTHING never raises 23505, so a duplicate leaves the
//     transaction usable, and a concurrent claim of the same key waits on the first
//     transaction's uncommitted row;
//   - with CountAttempt: DELETE of the attempt record, which commits with a successful
//     delivery and is undone by a rollback.
//
// The attempt transaction commits asynchronously (synchronous_commit off): it survives any
// crash of the consumer and any rollback, and only a crash of the PostgreSQL server itself
// within wal_writer_delay (200 ms by default) can lose the latest increments, which costs a
// poison message at most one extra attempt. A duplicate costs one more round trip, to read
// the stored payload hash. The transaction holds one pool connection until Commit or
// Rollback. Errors are pgx's, wrapped with the failing step; on error the transaction is
// rolled back and the connection released.
func (s *Store) BeginClaim(ctx context.Context, opts inbox.TxOptions, c inbox.Claim) (inbox.Tx, inbox.ClaimResult, error) {
	var res inbox.ClaimResult
	lvl, err := isoLevel(opts.Isolation)
	if err != nil {
		return nil, res, err
	}
	timeouts := func(b *pgx.Batch) {
		if opts.LockTimeout > 0 {
			b.Queue("select set_config('lock_timeout', $1, true)", strconv.FormatInt(opts.LockTimeout.Milliseconds(), 10))
		}
		if opts.StatementTimeout > 0 {
			b.Queue("select set_config('statement_timeout', $1, true)", strconv.FormatInt(opts.StatementTimeout.Milliseconds(), 10))
		}
	}
	b := &pgx.Batch{}
	counted := false // the attempt transaction committed
	if opts.CountAttempt {
		// The batch's transaction (the one pgx hands back) is the second BEGIN below; the
		// first is the attempt's own, committed inside the same pipeline.
		b.BeginTx(pgx.TxOptions{})
		b.Queue("set local synchronous_commit to off")
		timeouts(b)
		b.Queue(s.attemptSQL, c.MessageID, c.ConsumerName).QueryRow(func(row pgx.Row) error {
			return row.Scan(&res.Attempt, &res.DeadLettered)
		})
		b.Queue("commit").Exec(func(ct pgconn.CommandTag) error {
			counted = ct.String() == "COMMIT"
			return nil
		})
		b.Queue("begin isolation level " + strings.ToLower(string(lvl)))
	} else {
		b.BeginTx(pgx.TxOptions{IsoLevel: lvl})
	}
	timeouts(b)
	var tag pgconn.CommandTag
	b.Queue(s.claimSQL, c.MessageID, c.ConsumerName, nullIfEmpty(c.MessageType), nullIfEmpty(c.CorrelationID), c.PayloadHash).
		Exec(func(ct pgconn.CommandTag) error { tag = ct; return nil })
	if opts.CountAttempt {
		b.Queue(s.clearAttemptsSQL, c.MessageID, c.ConsumerName)
	}
	br := s.pool.SendBatch(ctx, b)
	tx := br.Tx()
	if err := br.Close(); err != nil {
		rollbackDetached(ctx, tx)
		if counted {
			// The claim never happened, so this delivery did not reach the handler: take
			// its attempt back, so that a lock wait or a timeout during the claim does not
			// bring an unprocessed message closer to the dead-letter topic.
			s.uncountAttempt(ctx, c)
		}
		return nil, inbox.ClaimResult{}, err
	}
	res.Claimed = tag.RowsAffected() == 1
	if !res.Claimed {
		err := tx.QueryRow(ctx, "SELECT payload_hash FROM "+s.table+" WHERE message_id = $1 AND consumer_name = $2",
			c.MessageID, c.ConsumerName).Scan(&res.StoredPayloadHash)
		if err != nil {
			rollbackDetached(ctx, tx)
			if counted {
				s.uncountAttempt(ctx, c)
			}
			return nil, inbox.ClaimResult{}, fmt.Errorf("read stored payload hash: %w", err)
		}
	}
	return &claimTx{tx: tx}, res, nil
}

// uncountAttempt takes back an attempt counted for a delivery whose claim failed. It is best
// effort: when the database is unreachable it fails too, and the attempt stays counted.
func (s *Store) uncountAttempt(ctx context.Context, c inbox.Claim) {
	uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), inbox.DefaultFinishTimeout)
	defer cancel()
	_, _ = s.pool.Exec(uctx, "UPDATE "+s.attempts+" SET attempts = attempts - 1"+
		" WHERE message_id = $1 AND consumer_name = $2 AND attempts > 0 AND dead_lettered_at IS NULL",
		c.MessageID, c.ConsumerName)
}

// rollbackDetached rolls tx back (releasing its connection; pgxpool destroys it if it is not
// idle afterwards) even when ctx is already cancelled.
func rollbackDetached(ctx context.Context, tx pgx.Tx) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), inbox.DefaultFinishTimeout)
	defer cancel()
	_ = tx.Rollback(rctx)
}

// maxErrorBytes bounds the last_error column, in bytes.
const maxErrorBytes = 1024

// RecordFailure implements inbox.Store: it stores errText, truncated to 1,024 bytes on a UTF-8
// boundary, as the key's last error.
func (s *Store) RecordFailure(ctx context.Context, messageID, consumerName, errText string) error {
	_, err := s.pool.Exec(ctx, "UPDATE "+s.attempts+" SET last_error = $3 WHERE message_id = $1 AND consumer_name = $2",
		messageID, consumerName, truncateUTF8(errText, maxErrorBytes))
	if err != nil {
		return fmt.Errorf("record failure: %w", err)
	}
	return nil
}

// MarkDeadLettered implements inbox.Store. It creates the attempt record when it does not
// exist (a message dead-lettered on its first delivery).
func (s *Store) MarkDeadLettered(ctx context.Context, messageID, consumerName, reason string) error {
	_, err := s.pool.Exec(ctx, "INSERT INTO "+s.attempts+" AS a (message_id, consumer_name, dead_lettered_at, dead_letter_reason)"+
		" VALUES ($1, $2, now(), $3) ON CONFLICT (message_id, consumer_name) DO UPDATE"+
		" SET dead_lettered_at = now(), dead_letter_reason = EXCLUDED.dead_letter_reason",
		messageID, consumerName, truncateUTF8(reason, maxErrorBytes))
	if err != nil {
		return fmt.Errorf("mark dead-lettered: %w", err)
	}
	return nil
}

// Replay implements inbox.Store: it deletes the key's dead-lettered attempt record.
func (s *Store) Replay(ctx context.Context, messageID, consumerName string) (bool, error) {
	tag, err := s.pool.Exec(ctx, "DELETE FROM "+s.attempts+" WHERE message_id = $1 AND consumer_name = $2 AND dead_lettered_at IS NOT NULL",
		messageID, consumerName)
	if err != nil {
		return false, fmt.Errorf("replay: %w", err)
	}
	return tag.RowsAffected() == 1, nil
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

// Commit commits; an error wraps inbox.ErrCommitRolledBack when the server answered ROLLBACK
// (pgx.ErrTxCommitRollback: a statement in the transaction had failed), which is a definite
// outcome. Any other error leaves the outcome unknown.
func (t *claimTx) Commit(ctx context.Context) error {
	err := t.tx.Commit(ctx)
	if errors.Is(err, pgx.ErrTxCommitRollback) {
		return fmt.Errorf("%w: %w", inbox.ErrCommitRolledBack, err)
	}
	return err
}

func (t *claimTx) Rollback(ctx context.Context) error {
	if err := t.tx.Rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return err
	}
	return nil
}
