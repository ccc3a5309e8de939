// Package pgstore is the PostgreSQL (pgx v5) implementation of the inbox's Store and of its
// optional capabilities (inbox.AttemptStore, inbox.Purger): the claim SQL, the embedded
// migrations and the accessor that hands the inbox transaction to handlers.
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
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
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
	// DefaultPurgeBatchSize is the number of rows Purge deletes per transaction when
	// PurgeParams.BatchSize is zero.
	DefaultPurgeBatchSize = 5000
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

// ValidateIdentifier checks a name the project turns into a PostgreSQL identifier (a schema, a
// table, an outbox topic): a letter or underscore, then letters, digits or underscores, at
// most maxBytes bytes (at most 63, PostgreSQL's NAMEDATALEN-1; a longer name would be
// truncated silently). It returns nil or an error wrapping inbox.ErrInvalidConfig that names
// what (e.g. "pgstore: table name"). Names are always quoted as well (pgx.Identifier).
func ValidateIdentifier(what, name string, maxBytes int) error {
	if !identifierRE.MatchString(name) || len(name) > min(maxBytes, 63) {
		return fmt.Errorf("%w: %s %q: want letters, digits and underscores, not starting with a digit, at most %d bytes",
			inbox.ErrInvalidConfig, what, name, min(maxBytes, 63))
	}
	return nil
}

// Config names the inbox table and holds the PostgreSQL settings of the inbox transaction.
// Names are validated by ValidateIdentifier and always quoted.
type Config struct {
	// Schema holding the table. Default: DefaultSchema. Migrate creates it when missing.
	Schema string
	// Table name. Default: DefaultTable. At most 47 bytes, so that the derived index name
	// "<table>_received_at_idx" fits PostgreSQL's 63-byte identifier limit.
	Table string
	// LockTimeout bounds every lock wait in the inbox transaction (PostgreSQL lock_timeout,
	// set locally; an expired wait fails with SQLSTATE 55P03), including a concurrent
	// duplicate's wait behind a slow handler's uncommitted claim and a counted delivery's
	// wait for the key's attempt lock. Zero keeps the server's setting.
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
	// ClaimLockTimeout bounds how long a claim holds its pool connection while it waits on a
	// lock of its key (the uncommitted claim of a delivery in flight, the key's attempt
	// lock). A claim whose key is held rolls back, releases the connection and waits in
	// process, without one, then tries again (see claimwait.go), until the key is free or the
	// claim's context ends (the inbox's ClaimTimeout; ErrClaimInFlight). So a flood of copies
	// of one message cannot hold every pool connection and starve other keys.
	//
	// Zero, the default: a single claim never waits on the server for its key. Every claim
	// holds its key's transaction-level advisory lock until it commits or rolls back, and a
	// claim only tries that lock (pg_try_advisory_xact_lock, in the claim statement itself):
	// held means in flight. An uncounted batch claim tries its members' key locks the same
	// way; a counted batch's locks on its keys, and a count-first delivery's lock on its key,
	// wait up to DefaultClaimLockTimeout (lock_timeout, 55P03 past it). Positive: every claim
	// waits on a lock of its key up to this long, set as lock_timeout inside the claim
	// statement and restored by the same statement (no extra statement, but about 0.07 of
	// the bare rate at 8 deliveries, docs/benchmarks.md; it also bounds waits on other locks,
	// a partition's DDL for one). With LockTimeout also set, LockTimeout bounds the wait
	// instead. Negative: the claim waits on the server, holding its connection.
	ClaimLockTimeout time.Duration
}

// Store is the pgx v5 inbox store. It is safe for concurrent use.
type Store struct {
	pool     *pgxpool.Pool
	cfg      Config
	table    string // quoted "schema"."table"
	versions string // quoted "schema".watermill_inbox_migrations
	attempts string // quoted "schema"."<table>_attempts"

	recordSQL, countSQL, hashSQL, clearSQL, clearProcessedSQL string

	// Layout and partitioning (layout.go): the inbox table's key predicate on $1 and $2,
	// the consumer predicate on a given parameter, the consumers table (compact layout) and
	// the consumer names known to be registered in it.
	keyMatch      string
	consumerMatch func(param string) string
	consumers     string
	registered    sync.Map
	// The claim statement's forms (buildClaims).
	lockedClaimSQL, lockedClaimLTSQL, tryClaimSQL string
	// The batch claim's statements (batchSQL), built once.
	batch batchSQL
}

var (
	_ inbox.Store           = (*Store)(nil)
	_ inbox.AttemptStore    = (*Store)(nil)
	_ inbox.Purger          = (*Store)(nil)
	_ inbox.FaultClassifier = (*Store)(nil)
)

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
	if err := ValidateIdentifier("pgstore: schema name", cfg.Schema, 63); err != nil {
		return nil, err
	}
	if err := ValidateIdentifier("pgstore: table name", cfg.Table, 47); err != nil {
		return nil, err
	}
	if err := validateLayout(cfg); err != nil {
		return nil, err
	}
	table := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	attempts := pgx.Identifier{cfg.Schema, cfg.Table + "_attempts"}.Sanitize()
	s := &Store{
		cfg:      cfg,
		table:    table,
		versions: pgx.Identifier{cfg.Schema, migrationsTable}.Sanitize(),
		attempts: attempts,
		// The key's attempt record, read in a statement of its own after the claim, so that
		// under READ COMMITTED it sees what the transaction it waited for recorded.
		recordSQL: "SELECT attempts, last_error, dead_lettered_at IS NOT NULL, dead_letter_reason FROM " + attempts +
			" WHERE message_id = $1 AND consumer_name = $2",
		// Counts a delivery unless its key is already processed or dead-lettered, or its
		// record already holds $3 (the count limit) attempts.
		countSQL: "INSERT INTO " + attempts + " AS a (message_id, consumer_name)" +
			" SELECT $1, $2 WHERE NOT EXISTS (SELECT 1 FROM " + table + " WHERE message_id = $1 AND consumer_name = $2)" +
			" ON CONFLICT (message_id, consumer_name) DO UPDATE SET attempts = a.attempts + 1, last_attempt_at = now()" +
			" WHERE a.dead_lettered_at IS NULL AND a.attempts < $3::int",
		hashSQL:  "SELECT payload_hash FROM " + table + " WHERE message_id = $1 AND consumer_name = $2",
		clearSQL: "DELETE FROM " + attempts + " WHERE message_id = $1 AND consumer_name = $2 AND dead_lettered_at IS NULL",
		// After COMMIT: clears the record only if the claim really committed (COMMIT may have
		// answered ROLLBACK, which ends no pipeline).
		clearProcessedSQL: "DELETE FROM " + attempts + " WHERE message_id = $1 AND consumer_name = $2 AND dead_lettered_at IS NULL" +
			" AND EXISTS (SELECT 1 FROM " + table + " WHERE message_id = $1 AND consumer_name = $2)",
		keyMatch:      "message_id = $1 AND consumer_name = $2",
		consumerMatch: func(param string) string { return "consumer_name = " + param },
	}
	s.buildClaims("message_id, consumer_name, message_type, correlation_id, payload_hash", []string{"$1", "$2", "$3", "$4", "$5"}, "message_id, consumer_name", "$1::text")
	s.applyLayout()
	s.batch = s.batchSQL()
	return s, nil
}

// buildClaims builds the claim statement's three forms from the inbox table's columns, the
// VALUES expressions ($1 to $n, n = len(vals)), the conflict target, and first (vals[0] with
// its type spelled out, for a sub-select). Every form takes the key's transaction-level
// advisory lock ($n+1: lockKey) before its insert:
//
//   - lockedClaimSQL: INSERT ... VALUES (...) ON CONFLICT (...) DO NOTHING, the lock taken by
//     a sub-select in the first value, so the claim meets the key's lock exactly as a lock
//     statement sent before it would, one statement fewer (pg_advisory_xact_lock is
//     volatile: never folded away); a negative ClaimLockTimeout, or a positive one with
//     LockTimeout set;
//
//   - lockedClaimLTSQL: the same with the claim's lock_timeout ($n+2) set inside the
//     statement before it can wait (the transaction's own value saved in
//     watermill_inbox.lock_timeout first), and put back by RETURNING once the row is
//     inserted, so the handler's statements run under the transaction's own lock_timeout. A
//     claim that inserts nothing (a duplicate, or a lock wait past the timeout, SQLSTATE
//     55P03) is rolled back, so nothing needs restoring. No statement is added to the claim's
//     round trip. A positive ClaimLockTimeout;
//
//   - tryClaimSQL: INSERT ... SELECT <the same values> WHERE pg_try_advisory_xact_lock(...)
//     ON CONFLICT (...) DO NOTHING, the default (ClaimLockTimeout zero): the key's
//     transaction-level advisory lock ($n+1: lockKey) is tried, never waited for; when a
//     delivery in flight holds it the statement inserts nothing and waits for nothing, and the
//     stored-hash read that follows finds no row (claimOnce: errKeyHeld). Every claim of a
//     key holds that lock until its claim commits or rolls back (these three forms, the
//     count-first session lock, a counted batch's locks, an uncounted batch's tried locks),
//     so a claim that got the lock does not wait on the unique index either, whatever the
//     other claimant's configuration.
//
// VALUES expressions are computed before the row is inserted, so the sub-select runs before
// the insert can wait on a concurrent claim of the key (the unique index's speculative
// insertion). PostgreSQL types the parameters of INSERT ... SELECT from the target columns,
// as it does those of VALUES.
func (s *Store) buildClaims(cols string, vals []string, conflict, first string) {
	n := len(vals)
	stmt := func(firstVal, returning string) string {
		v := append([]string{firstVal}, vals[1:]...)
		return "INSERT INTO " + s.table + " (" + cols + ") VALUES (" + strings.Join(v, ", ") + ") ON CONFLICT (" + conflict + ") DO NOTHING" + returning
	}
	lock := func(param int) string { return fmt.Sprintf("pg_advisory_xact_lock(hashtextextended($%d, 0))", param) }
	lt := func(param int) string {
		return fmt.Sprintf("(SELECT set_config('lock_timeout', $%d, true) AS lt FROM (SELECT set_config('"+savedLockTimeout+"', current_setting('lock_timeout'), true) AS saved) AS saved) AS lt", param)
	}
	const restore = " RETURNING set_config('lock_timeout', current_setting('" + savedLockTimeout + "'), true)"
	s.lockedClaimSQL = stmt("(SELECT "+first+" FROM (SELECT "+lock(n+1)+") AS key_lock)", "")
	s.lockedClaimLTSQL = stmt("(SELECT "+first+" FROM (SELECT "+lock(n+1)+" FROM "+lt(n+2)+") AS key_lock)", restore)
	s.tryClaimSQL = "INSERT INTO " + s.table + " (" + cols + ") SELECT " + strings.Join(vals, ", ") +
		fmt.Sprintf(" WHERE pg_try_advisory_xact_lock(hashtextextended($%d, 0))", n+1) +
		" ON CONFLICT (" + conflict + ") DO NOTHING"
}

// Table returns the quoted, schema-qualified inbox table name, e.g. "public"."inbox_processed_messages".
func (s *Store) Table() string { return s.table }

// AttemptsTable returns the quoted, schema-qualified attempts table name, e.g.
// "public"."inbox_processed_messages_attempts".
func (s *Store) AttemptsTable() string { return s.attempts }

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

// Claim implements inbox.Store. BEGIN, the local timeouts and the claim travel in one
// pipelined round trip (pgx's Batch.BeginTx):
//
//	BEGIN ISOLATION LEVEL ...; INSERT ... SELECT ... WHERE pg_try_advisory_xact_lock(...) ON CONFLICT (message_id, consumer_name) DO NOTHING
//
// Zero rows inserted means a duplicate, or, when the stored payload hash read next finds no
// row, a key held by a delivery in flight: the claim then gives its connection back and
// tries again in process (Config.ClaimLockTimeout; ErrClaimInFlight when its context ends).
// ON CONFLICT DO NOTHING never raises 23505. A duplicate costs one more round trip, to read
// the stored payload hash, then the store rolls its transaction back. Errors are pgx's, wrapped with the failing step; on error the
// transaction is rolled back and the connection released.
func (s *Store) Claim(ctx context.Context, p inbox.ClaimParams) (inbox.Tx, inbox.ClaimResult, error) {
	t, res, err := s.claim(ctx, inbox.CountedClaimParams{ClaimParams: p}, false)
	if t == nil {
		return nil, res.ClaimResult, err
	}
	return t, res.ClaimResult, err
}

// ClaimCounted implements inbox.AttemptStore. Everything before the handler travels in one
// pipelined round trip:
//
//   - with CountFirst: BEGIN; the local timeouts; pg_advisory_lock on the key (a
//     session-level lock, held until the claim transaction ends, so counted deliveries of
//     one key count one at a time) with synchronous_commit set off locally, in one
//     statement; the count, unless the key
//     is processed (INSERT ... SELECT ... WHERE NOT EXISTS ... ON CONFLICT DO UPDATE SET
//     attempts = attempts + 1); COMMIT;
//   - BEGIN ISOLATION LEVEL ...; the local timeouts; the claim (which first takes the key's
//     transaction-level advisory lock when the delivery did not count first); the key's
//     attempt record, read by a statement of its own (so that under READ COMMITTED it sees what a delivery that
//     held the claim before recorded).
//
// The count commits asynchronously (synchronous_commit off): it survives any crash of the
// consumer and any rollback; only a crash of the PostgreSQL server itself within
// wal_writer_delay (200 ms by default) can lose it, which costs a poison message one extra
// attempt. A dead-lettered key is not claimed. A duplicate costs one more round trip (the
// stored payload hash, the rollback, and for a counted delivery the removal of its count).
func (s *Store) ClaimCounted(ctx context.Context, p inbox.CountedClaimParams) (inbox.CountedTx, inbox.CountedClaimResult, error) {
	t, res, err := s.claim(ctx, p, true)
	if t == nil {
		return nil, res, err
	}
	return t, res, err
}

func (s *Store) claimOnce(ctx context.Context, p inbox.CountedClaimParams, counted bool) (*claimTx, inbox.CountedClaimResult, error) {
	var res inbox.CountedClaimResult
	lvl, err := isoLevel(p.Isolation)
	if err != nil {
		return nil, res, err
	}
	period, err := s.period(p.ClaimParams)
	if err != nil {
		return nil, res, err
	}
	if err := s.registerConsumer(ctx, p.Key.ConsumerName); err != nil {
		return nil, res, err
	}
	conn, err := s.acquire(ctx)
	if err != nil {
		return nil, res, err
	}
	t := &claimTx{s: s, conn: conn, key: p.Key, period: period, finish: p.FinishTimeout, counted: counted, iso: lvl}
	if t.finish <= 0 {
		t.finish = inbox.DefaultFinishTimeout
	}
	k := p.Key
	b := &pgx.Batch{}
	lt := s.lockWait()
	if counted && p.CountFirst {
		// The transaction pgx hands back is the second BEGIN below: the first is the
		// count's own, committed inside the same pipeline.
		b.BeginTx(pgx.TxOptions{})
		s.queueTimeouts(b)
		// The key's session lock, with synchronous_commit off for this transaction only
		// (set_config with is_local), and the claim's lock_timeout, in one statement: the
		// sub-select's settings are made before the lock is asked for.
		lockSQL, lockArgs := "select pg_advisory_lock(hashtextextended($1, 0)), set_config('synchronous_commit', 'off', true)", []any{s.lockKey(k)}
		if lt > 0 {
			lockSQL = "select pg_advisory_lock(hashtextextended($1, 0)) from (select set_config('synchronous_commit', 'off', true) as sc, set_config('lock_timeout', $2, true) as lt) as settings"
			lockArgs = append(lockArgs, millis(lt))
		}
		b.Queue(lockSQL, lockArgs...).Exec(func(pgconn.CommandTag) error {
			t.locked = true
			return nil
		})
		b.Queue(s.countSQL, append(s.keyArgs(k, period), countLimit(p.CountLimit))...).Exec(func(ct pgconn.CommandTag) error {
			res.Counted = ct.RowsAffected() == 1
			return nil
		})
		b.Queue("commit")
		b.Queue("begin isolation level " + strings.ToLower(string(lvl)))
	} else {
		b.BeginTx(pgx.TxOptions{IsoLevel: lvl})
	}
	s.queueTimeouts(b)
	// Every claim takes the key's lock, for its transaction, inside the claim statement
	// (buildClaims): tried by default, else waited for (under the claim's lock_timeout when
	// one is set, restored once the row is in). A counted claim that did not count first
	// needs it: while its handler runs no copy can count, so its Fail reports its own
	// failure, never a waiting copy's count; and every claim holds it, so that a tried claim
	// of the key never waits on the unique index behind it. A count-first delivery already
	// holds the key's session lock, so its own try succeeds.
	claimSQL, args := s.lockedClaimSQL, append(s.claimArgs(p.ClaimParams, period), s.lockKey(k))
	switch {
	case s.tryLock():
		claimSQL = s.tryClaimSQL
	case lt > 0:
		claimSQL, args = s.lockedClaimLTSQL, append(args, millis(lt))
	}
	b.Queue(claimSQL, args...).Exec(func(ct pgconn.CommandTag) error {
		res.Claimed = ct.RowsAffected() == 1
		return nil
	})
	noRecord := counted && p.NoRecord && !p.CountFirst
	if counted && !noRecord {
		b.Queue(s.recordSQL, k.MessageID, k.ConsumerName).QueryRow(func(row pgx.Row) error {
			var attempts int32
			var lastError, reason *string
			err := row.Scan(&attempts, &lastError, &res.Record.DeadLettered, &reason)
			if errors.Is(err, pgx.ErrNoRows) {
				return nil
			}
			res.Record.Attempts = int(attempts)
			res.Record.LastError = deref(lastError)
			res.Record.DeadLetterReason = deref(reason)
			return err
		})
	}
	err = s.sendClaim(ctx, conn, b, t)
	if err != nil {
		if counted && p.CountFirst {
			// A session lock whose wait timed out (55P03) or was cancelled just as it was
			// granted stays held though the statement failed: release it in any case.
			t.locked = true
		}
		_ = t.end(ctx, func(ctx context.Context) error {
			_, _ = t.conn.Exec(ctx, "rollback")
			if res.Counted {
				// The claim never happened, so this delivery did not reach the handler:
				// take its count back, on this connection (still under the key's lock), or
				// on another when this one is closed.
				back := inbox.AttemptParams{Key: k, AttemptsDelta: -1}
				if t.conn.Conn().IsClosed() {
					_, _ = s.adjust(ctx, s.pool, back)
				} else if _, err := s.adjust(ctx, conn, back); err != nil {
					_, _ = s.adjust(ctx, s.pool, back)
				}
			}
			return nil
		})
		return nil, inbox.CountedClaimResult{}, fmt.Errorf("claim: %w", s.wrapNoPartition(err, period))
	}
	t.rec = res.Record
	// With NoRecord the record was not read and Commit leaves it: a record of a key claimed
	// that way belongs to another copy, pending or dead-lettered, whose claim clears it.
	t.dirty = !noRecord && (res.Counted || res.Record.Attempts > 0 || res.Record.LastError != "" || lvl != pgx.ReadCommitted)
	switch {
	case res.Claimed && res.Record.DeadLettered:
		// Not claimed after all: the rollback takes the claim back.
		res.Claimed = false
		if err := t.end(ctx, t.tx.Rollback); err != nil {
			return nil, inbox.CountedClaimResult{}, fmt.Errorf("claim: roll back a dead-lettered key: %w", err)
		}
		return nil, res, nil
	case res.Claimed:
		return t, res, nil
	}
	// A duplicate: read the stored hash and end the transaction in one round trip; with
	// attempts, also delete the key's attempt record: the key is processed, so a live
	// record (this delivery's count, or one left by an earlier try) is stale. With the
	// tried lock (tryClaimSQL), no stored row means the key's lock was held by a delivery in
	// flight, not a duplicate: the record is then left alone (the delete checks the row is
	// there) and the claim reports errKeyHeld.
	res.Record = inbox.AttemptRecord{}
	held := false
	err = t.end(ctx, func(ctx context.Context) error {
		b := &pgx.Batch{}
		b.Queue(s.hashSQL, s.keyArgs(k, period)...).QueryRow(func(row pgx.Row) error {
			err := s.scanHash(row, &res.StoredPayloadHash)
			if errors.Is(err, pgx.ErrNoRows) && s.tryLock() {
				held = true
				return nil
			}
			return err
		})
		b.Queue("rollback")
		switch {
		case counted && s.tryLock():
			b.Queue(s.clearProcessedSQL, s.keyArgs(k, period)...)
		case counted:
			b.Queue(s.clearSQL, k.MessageID, k.ConsumerName)
		}
		if err := conn.Conn().SendBatch(ctx, b).Close(); err != nil {
			_, _ = conn.Exec(ctx, "rollback")
			return fmt.Errorf("read stored payload hash: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, inbox.CountedClaimResult{}, err
	}
	if held {
		if res.Counted {
			// Not expected (a count-first delivery holds the key's lock, so its try
			// succeeds), but a count must never outlive a claim that did not happen.
			_, _ = s.adjust(ctx, s.pool, inbox.AttemptParams{Key: k, AttemptsDelta: -1})
		}
		return nil, inbox.CountedClaimResult{}, fmt.Errorf("claim: %w", errKeyHeld)
	}
	return nil, res, nil
}

// sendClaim runs the claim pipeline b on conn. It is sent on a context that ctx's end does not
// break: pgx would close the connection, and with it the knowledge of which statements ran (a
// count that committed could not be taken back). When ctx ends first (the claim timeout, the
// router shutting down), sendClaim asks the server to cancel the statement that waits
// (PostgreSQL's cancel request; SQLSTATE 57014), so the pipeline ends on a healthy connection
// with its callbacks run, and reports ctx's error. Such a connection is closed after the
// delivery ends rather than reused, since a cancel request can arrive late. If the server does
// not answer within the finish timeout after that, the connection is closed.
func (s *Store) sendClaim(ctx context.Context, conn *pgxpool.Conn, b *pgx.Batch, t *claimTx) error {
	var fired atomic.Bool
	t.sent = make(chan struct{})
	sent, done := t.sent, make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(done)
		fired.Store(true)
		cctx, cancel := context.WithTimeout(context.Background(), t.finish)
		defer cancel()
		// Never touch the PgConn itself here (it is not safe for concurrent use): expire the
		// socket instead, so the claiming goroutine's read fails and pgconn closes it there.
		abort := func() { _ = conn.Conn().PgConn().Conn().SetDeadline(time.Now()) }
		if err := conn.Conn().PgConn().CancelRequest(cctx); err != nil {
			abort()
			return
		}
		select {
		case <-time.After(t.finish):
			abort() // the server did not answer: give up on it
		case <-sent:
		}
	})
	if err := ctx.Err(); err != nil {
		// Ended before anything was sent: a cancel request would find nothing to cancel.
		close(sent)
		if !stop() {
			<-done
		}
		t.poisoned = fired.Load()
		return err
	}
	br := conn.Conn().SendBatch(context.WithoutCancel(ctx), b)
	t.tx = br.Tx()
	err := br.Close()
	close(sent)
	if !stop() {
		<-done // it started: let it finish before anything else runs on conn
	}
	if fired.Load() {
		t.poisoned = true
		if err == nil {
			err = ctx.Err()
		}
		return fmt.Errorf("%w (%w)", ctx.Err(), err)
	}
	return err
}

// countLimit is the count statement's limit parameter: n, or no limit for n <= 0.
func countLimit(n int) int32 {
	if n <= 0 || n > math.MaxInt32 {
		return math.MaxInt32
	}
	return int32(n)
}

// lockKey is the text hashed (hashtextextended) into the key's advisory lock: table, consumer
// name and message ID, separated by a unit separator. Two keys that hash alike only share a
// lock, which serialises their counted deliveries and changes nothing else.
func (s *Store) lockKey(k inbox.Key) string {
	return s.table + "\x1f" + k.ConsumerName + "\x1f" + k.MessageID
}

// maxErrorBytes bounds the last_error and dead_letter_reason columns, in bytes.
const maxErrorBytes = 1024

// AdjustAttempts implements inbox.AttemptStore.
func (s *Store) AdjustAttempts(ctx context.Context, p inbox.AttemptParams) (int, error) {
	return s.adjust(ctx, s.pool, p)
}

// querier is what adjust runs on: the pool, or a connection acquired from it.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

func (s *Store) adjust(ctx context.Context, q querier, p inbox.AttemptParams) (int, error) {
	k := p.Key
	var n int32
	var err error
	if p.AttemptsDelta > 0 {
		err = q.QueryRow(ctx, "INSERT INTO "+s.attempts+" AS a (message_id, consumer_name, attempts, last_error)"+
			" SELECT $1, $2, $3, $4 WHERE NOT EXISTS (SELECT 1 FROM "+s.table+" WHERE "+s.keyMatch+")"+
			" ON CONFLICT (message_id, consumer_name) DO UPDATE SET attempts = a.attempts + EXCLUDED.attempts,"+
			" last_error = coalesce(EXCLUDED.last_error, a.last_error), last_attempt_at = now()"+
			" WHERE a.dead_lettered_at IS NULL RETURNING a.attempts", k.MessageID, k.ConsumerName, p.AttemptsDelta, nullIfEmpty(truncateUTF8(p.Error, maxErrorBytes))).Scan(&n)
	} else {
		// One statement, so it is applied wholly or not at all (Fail retries a refused one):
		// a record that would be left with no attempt and no error goes, any other is
		// updated. The two conditions exclude each other, so at most one part acts.
		err = q.QueryRow(ctx, "WITH d AS (DELETE FROM "+s.attempts+" WHERE message_id = $1 AND consumer_name = $2"+
			" AND dead_lettered_at IS NULL AND attempts + $3 <= 0 AND coalesce($4, last_error) IS NULL RETURNING 0 AS attempts),"+
			" u AS (UPDATE "+s.attempts+" SET attempts = greatest(attempts + $3, 0), last_error = coalesce($4, last_error)"+
			" WHERE message_id = $1 AND consumer_name = $2 AND dead_lettered_at IS NULL"+
			" AND NOT (attempts + $3 <= 0 AND coalesce($4, last_error) IS NULL) RETURNING attempts)"+
			" SELECT attempts FROM d UNION ALL SELECT attempts FROM u",
			k.MessageID, k.ConsumerName, p.AttemptsDelta, nullIfEmpty(truncateUTF8(p.Error, maxErrorBytes))).Scan(&n)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("adjust attempts: %w", err)
	}
	return int(n), nil
}

// MarkDeadLettered implements inbox.AttemptStore. It creates the attempt record when it does
// not exist (a message dead-lettered before any attempt was counted, such as a message the
// TooOldGuard refused), with zero attempts.
func (s *Store) MarkDeadLettered(ctx context.Context, p inbox.AttemptParams) error {
	_, err := s.pool.Exec(ctx, "INSERT INTO "+s.attempts+" AS a (message_id, consumer_name, attempts, dead_lettered_at, dead_letter_reason)"+
		" VALUES ($1, $2, 0, now(), $3) ON CONFLICT (message_id, consumer_name) DO UPDATE"+
		" SET dead_lettered_at = now(), dead_letter_reason = EXCLUDED.dead_letter_reason",
		p.Key.MessageID, p.Key.ConsumerName, truncateUTF8(p.Error, maxErrorBytes))
	if err != nil {
		return fmt.Errorf("mark dead-lettered: %w", err)
	}
	return nil
}

// Replay implements inbox.AttemptStore: it deletes the key's dead-lettered attempt record. A
// record whose key is processed (a copy the producer sent again was applied after the dead
// letter) is deleted too, and reported false: replaying it would apply the message again once
// the inbox row is purged.
func (s *Store) Replay(ctx context.Context, p inbox.AttemptParams) (bool, error) {
	var unprocessed bool
	processed := " RETURNING NOT EXISTS (SELECT 1 FROM " + s.table + " WHERE " + s.keyMatch + ")"
	if s.cfg.Layout == LayoutCompact && !canonicalUUID(p.Key.MessageID) {
		// A record kept from the text layout (the conversion leaves the attempts table as it
		// is): the compact table cannot hold its key, so it is not processed.
		processed = " RETURNING true"
	}
	err := s.pool.QueryRow(ctx, "DELETE FROM "+s.attempts+" WHERE message_id = $1 AND consumer_name = $2 AND dead_lettered_at IS NOT NULL"+
		processed, p.Key.MessageID, p.Key.ConsumerName).Scan(&unprocessed)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("replay: %w", err)
	}
	return unprocessed, nil
}

// Purge implements inbox.Purger: it deletes processed rows received before p.Before (in the
// compact layout: whose whole minute of received_minute is before it), p.BatchSize rows per transaction (default DefaultPurgeBatchSize), oldest first,
// until a batch deletes fewer rows than its size or ctx ends. It uses the received_at index.
func (s *Store) Purge(ctx context.Context, p inbox.PurgeParams) (inbox.PurgeResult, error) {
	var res inbox.PurgeResult
	size := p.BatchSize
	if size <= 0 {
		size = DefaultPurgeBatchSize
	}
	where := " WHERE " + s.receivedBefore("$1") + " AND ($2::text IS NULL OR " + s.consumerMatch("$2") + ") ORDER BY " + s.receivedColumn() + " LIMIT $3"
	q := s.purgeRowsSQL(where)
	for {
		var n int64
		if err := s.pool.QueryRow(ctx, q, p.Before, nullIfEmpty(p.ConsumerName), size).Scan(&n); err != nil {
			return res, fmt.Errorf("purge: %w", err)
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

// Retryable implements inbox.Store: SQLSTATE 40001 and 40P01.
func (s *Store) Retryable(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == SQLStateSerializationFailure || pgErr.Code == SQLStateDeadlockDetected
	}
	return false
}

// ConfigurationFault implements inbox.FaultClassifier: SQLSTATE class 42 (syntax error or
// access rule violation, e.g. 42501 insufficient_privilege, 42P01 undefined_table, 42703
// undefined_column), class 28 (invalid authorization specification), 3D000
// (invalid_catalog_name) and 3F000 (invalid_schema_name).
func (s *Store) ConfigurationFault(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	switch {
	case strings.HasPrefix(pgErr.Code, "42"), strings.HasPrefix(pgErr.Code, "28"):
		return true
	}
	return pgErr.Code == "3D000" || pgErr.Code == "3F000"
}

func nullIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
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

// PgxTx returns the pgx transaction of an inbox transaction opened by a pgstore Store, and
// false for a transaction of another store. The outbox uses it to write in the inbox
// transaction it is handed.
func PgxTx(tx inbox.Tx) (pgx.Tx, bool) {
	if b, ok := tx.(*batchTx); ok && b != nil {
		return b.tx, true // a batch's (group commit)
	}
	if p, ok := tx.(PgxTxer); ok {
		ptx := p.PgxTx()
		return ptx, ptx != nil
	}
	t, ok := tx.(*claimTx)
	if !ok || t == nil {
		return nil, false
	}
	return t.tx, true
}

// PgxTxer is implemented by inbox transactions built on pgx outside this package (the
// store-then-process inbox's worker transactions, package middleware/deferred): PgxTx
// returns their pgx transaction for them, so the outbox writes in it.
type PgxTxer interface {
	// PgxTx returns the open pgx transaction, or nil when there is none.
	PgxTx() pgx.Tx
}

// ContextWithTx returns ctx carrying tx where TxFromContext finds it. The store-then-process
// worker (package middleware/deferred) uses it, so one handler reads its transaction the same
// way in both modes. Handlers do not need it.
func ContextWithTx(ctx context.Context, tx pgx.Tx) context.Context {
	return context.WithValue(ctx, txKey{}, tx)
}

// claimTx is an open claim transaction on a connection acquired for it. It releases the
// connection (after the advisory lock, when it holds one) once it ends.
type claimTx struct {
	s       *Store
	conn    *pgxpool.Conn
	tx      pgx.Tx
	key     inbox.Key
	period  time.Time // the claim's partition period (partitioned mode)
	iso     pgx.TxIsoLevel
	finish  time.Duration
	counted bool                // a counted claim (ClaimCounted)
	locked  bool                // holds the key's advisory lock
	rec     inbox.AttemptRecord // the attempt record read at the claim
	// sent is closed once the claim pipeline returned; poisoned marks a connection a cancel
	// request was sent on, closed rather than reused.
	sent     chan struct{}
	poisoned bool
	// dirty: the key may have an attempt record for the commit to clear (one was read, this
	// delivery counted, or the snapshot could have missed one).
	dirty bool
	ended bool
}

func (t *claimTx) Context(ctx context.Context) context.Context {
	return context.WithValue(ctx, txKey{}, t.tx)
}

// end runs f on a context detached from ctx's cancellation and bounded by the finish
// timeout, then releases the advisory lock (when held and f did not) and the connection. A
// connection whose lock cannot be released is closed, so the lock cannot outlive the delivery.
func (t *claimTx) end(ctx context.Context, f func(context.Context) error) error {
	if t.ended {
		return nil
	}
	t.ended = true
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.finish)
	defer cancel()
	err := f(dctx)
	if t.locked {
		if _, uerr := t.conn.Exec(dctx, unlockSQL); uerr != nil {
			_ = t.conn.Conn().Close(dctx)
		}
	}
	if t.poisoned {
		_ = t.conn.Conn().Close(dctx)
	}
	t.conn.Release()
	return err
}

// unlockSQL releases the key's advisory lock (the only session lock the store takes).
const unlockSQL = "select pg_advisory_unlock_all()"

// finishPipeline sends sqls (no parameters but the key, given as $1 and $2 where used) as
// unnamed statements in one pipeline, then, when the transaction holds the key's advisory
// lock, the unlock: in the same statement as a last clearProcessedSQL (a data-modifying CTE
// always runs to completion, and the unlock runs only if it succeeded), else as a statement of
// its own. It returns each statement's result in order (fewer after an error: the server
// skips the rest of the pipeline) and whether the lock was released.
func (t *claimTx) finishPipeline(ctx context.Context, sqls ...string) ([]*pgconn.Result, error) {
	sqls = slices.Clone(sqls)
	unlockAt := -1 // the statement whose success releases the lock
	if t.locked {
		if last := len(sqls) - 1; last >= 0 && sqls[last] == t.s.clearProcessedSQL {
			sqls[last] = "WITH cleared AS (" + t.s.clearProcessedSQL + ") " + unlockSQL
			unlockAt = last
		} else {
			sqls = append(sqls, unlockSQL)
			unlockAt = len(sqls) - 1
		}
	}
	if len(sqls) == 1 && !strings.Contains(sqls[0], "$1") {
		// COMMIT or ROLLBACK alone: the simple protocol's one message, as pgx's own Tx sends
		// it (the extended protocol would parse, bind and describe it as an unnamed statement).
		return t.conn.Conn().PgConn().Exec(ctx, sqls[0]).ReadAll()
	}
	b := &pgconn.Batch{}
	key := [][]byte{[]byte(t.key.MessageID), []byte(t.key.ConsumerName)}
	if t.s.cfg.Partitioning != nil {
		key = append(key, []byte(t.period.Format(time.RFC3339)))
	}
	for _, q := range sqls {
		var args [][]byte
		if strings.Contains(q, "$1") {
			args = key[:2]
			if strings.Contains(q, "$3") {
				args = key
			}
		}
		b.ExecParams(q, args, nil, nil, nil)
	}
	results, err := t.conn.Conn().PgConn().ExecBatch(ctx, b).ReadAll()
	if unlockAt >= 0 && err == nil && len(results) > unlockAt && results[unlockAt].Err == nil {
		t.locked = false
	}
	return results, err
}

// Commit commits, in one round trip with whatever must accompany it: for a counted claim whose
// key may have an attempt record, a statement after COMMIT deletes the record if the claim is
// now processed (so it sees records committed after the claim's snapshot, at every isolation
// level, and deletes nothing when COMMIT answered ROLLBACK); a crash between the two leaves a
// stale record of a processed key, which the key's next duplicate removes. A held advisory
// lock is released in the same pipeline (in the clean-up statement itself when there is one).
//
// An error wraps inbox.ErrCommitRolledBack when the rollback is certain: the server answered
// ROLLBACK (a statement in the transaction had failed) or COMMIT raised an error (a
// *pgconn.PgError, such as a deferred constraint's SQLSTATE 23505, or 40001 under
// SERIALIZABLE, which Retryable also reports). Any other error leaves the outcome unknown.
func (t *claimTx) Commit(ctx context.Context) error {
	return t.end(ctx, func(ctx context.Context) error {
		sqls := []string{"commit"}
		if t.counted && t.dirty {
			sqls = append(sqls, t.s.clearProcessedSQL)
		}
		results, err := t.finishPipeline(ctx, sqls...)
		switch {
		case len(results) > 0 && results[0].Err != nil:
			err = results[0].Err
		case len(results) > 0 && results[0].CommandTag.String() != "COMMIT":
			err = pgx.ErrTxCommitRollback
		case len(results) > 0:
			return nil // committed; a failed clean-up after COMMIT only leaves a stale record
		}
		var pgErr *pgconn.PgError
		if errors.Is(err, pgx.ErrTxCommitRollback) || errors.As(err, &pgErr) {
			return fmt.Errorf("%w: %w", inbox.ErrCommitRolledBack, err)
		}
		return err
	})
}

func (t *claimTx) Rollback(ctx context.Context) error {
	return t.end(ctx, func(ctx context.Context) error {
		results, err := t.finishPipeline(ctx, "rollback")
		if err == nil && len(results) > 0 {
			err = results[0].Err
		}
		return err
	})
}

// failAcquireTimeout bounds Fail's wait for a second pool connection; past it Fail records
// after the rollback instead.
const failAcquireTimeout = 500 * time.Millisecond

// Fail implements inbox.CountedTx. It updates the attempt record (AttemptsDelta added, the
// error stored) on a second pool connection, committed while this transaction still holds
// the claim, and only then rolls this transaction back (the handler's writes and the claim),
// so a copy waiting on the claim reads the updated record. When no second connection is free
// within failAcquireTimeout (a pool exhausted by deliveries that all fail at once), it rolls
// back first and updates the record afterwards: a copy racing that update may read the count
// one short.
func (t *claimTx) Fail(ctx context.Context, p inbox.FailParams) (int, error) {
	if t.ended {
		return 0, nil
	}
	if p.AttemptsDelta == 0 && p.Error == "" {
		return t.rec.Attempts, t.Rollback(ctx) // nothing to record
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.finish)
	defer cancel()
	params := inbox.AttemptParams{Key: t.key, AttemptsDelta: p.AttemptsDelta, Error: p.Error}
	actx, acancel := context.WithTimeout(dctx, min(t.finish, failAcquireTimeout))
	conn, err := t.s.pool.Acquire(actx)
	acancel()
	if err != nil {
		rerr := t.Rollback(ctx)
		n, aerr := t.s.adjust(dctx, t.s.pool, params)
		if aerr != nil {
			return 0, fmt.Errorf("record the failure: %w", errors.Join(aerr, rerr))
		}
		return n, rerr
	}
	n, aerr := t.s.adjust(dctx, conn, params)
	conn.Release()
	rerr := t.Rollback(ctx)
	var pgErr *pgconn.PgError
	if errors.As(aerr, &pgErr) {
		// The server refused it, so nothing was applied: try once more, after the rollback.
		n, aerr = t.s.adjust(dctx, t.s.pool, params)
	}
	if aerr != nil {
		return 0, fmt.Errorf("record the failure: %w", errors.Join(aerr, rerr))
	}
	return n, rerr
}
