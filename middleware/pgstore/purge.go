package pgstore

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/ident"
	"github.com/watermill-inbox/watermill-inbox/internal/purge"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// The purge of expired rows: one SQL function per table kind, in this file only, so every
// storage mode (docs/retention.md) extends the purge here.

// WatermillTopic names a watermill-sql (v4) topic whose tables the purge covers: the messages
// table "watermill_<Topic>" and the offsets table "watermill_offsets_<Topic>" (watermill-sql's
// default PostgreSQL naming, which the outbox and the postgres broker adapter use).
type WatermillTopic struct {
	// Schema qualifies both tables; empty leaves them to the connection's search_path.
	Schema string
	// Topic is the watermill-sql topic (letters, digits, underscores).
	Topic string
}

// Validate returns an error wrapping inbox.ErrInvalidConfig for an invalid Topic or Schema
// name (see ValidateIdentifier).
func (w WatermillTopic) Validate() error {
	_, _, err := w.Tables()
	return err
}

// Tables returns the quoted names of the topic's messages and offsets tables, or an error
// wrapping inbox.ErrInvalidConfig for an invalid Topic or Schema name.
func (w WatermillTopic) Tables() (messages, offsets string, err error) {
	if err := ident.Validate("pgstore: watermill topic", w.Topic, 63-len("watermill_offsets_")); err != nil {
		return "", "", err
	}
	q := func(name string) string {
		if w.Schema == "" {
			return pgx.Identifier{name}.Sanitize()
		}
		return pgx.Identifier{w.Schema, name}.Sanitize()
	}
	if w.Schema != "" {
		if err := ident.Validate("pgstore: watermill topic schema", w.Schema, 63); err != nil {
			return "", "", err
		}
	}
	return q("watermill_" + w.Topic), q("watermill_offsets_" + w.Topic), nil
}

// PurgeExpiredParams are the inputs of PurgeExpired.
type PurgeExpiredParams struct {
	// BatchSize bounds the rows deleted per transaction. Default: DefaultPurgeBatchSize (5,000).
	BatchSize int
	// Pause is slept between two batches. Default: DefaultPurgePause; negative: no pause.
	Pause time.Duration
	// DryRun counts what would be deleted and deletes nothing.
	DryRun bool
	// Topics are watermill-sql topics (the outbox's, the postgres broker's) whose consumed
	// rows older than the retention window are purged too.
	Topics []WatermillTopic
	// Progress, when set, is called after every batch (and once per table in a dry run).
	Progress func(PurgeProgress)
}

// Purge kinds, in the order PurgeExpired runs them.
const (
	// PurgeKindInbox: processed rows whose received_at is older than the window.
	PurgeKindInbox = "inbox"
	// PurgeKindAttempts: attempt records of messages neither processed nor dead-lettered
	// whose last attempt is older than the window, and that no delivery holds.
	PurgeKindAttempts = "attempts"
	// PurgeKindDeadLetters: dead-lettered attempt records older than the dead-letter window.
	PurgeKindDeadLetters = "dead_letters"
	// PurgeKindTopic: watermill-sql messages below every consumer group's committed offset
	// and older than the window.
	PurgeKindTopic = "topic"
)

// PurgeProgress reports one table's progress during PurgeExpired.
type PurgeProgress struct {
	// Kind is one of the PurgeKind constants; Table the quoted table name.
	Kind, Table string
	// Rows deleted so far (in a dry run: rows that would be deleted).
	Rows int64
	// Batches run so far (0 in a dry run).
	Batches int
	// Done is true on a table's last report.
	Done bool
}

// PurgeReport is what PurgeExpired did (or, in a dry run, would do).
type PurgeReport struct {
	// Now is the database's clock when the purge began (the windows are measured from it).
	Now time.Time
	// Cutoff: rows written before it are expired (Now - Retention.Window).
	Cutoff time.Time
	// DeadLetterCutoff: dead-lettered records older than it are expired (Now -
	// Retention.DeadLetterWindow).
	DeadLetterCutoff time.Time
	// Tables has one entry per table purged, in order, each with Done set.
	Tables []PurgeProgress
	// DryRun is true when nothing was deleted.
	DryRun bool
}

// Rows returns the rows deleted (or counted, in a dry run) over every table.
func (r PurgeReport) Rows() int64 {
	var n int64
	for _, t := range r.Tables {
		n += t.Rows
	}
	return n
}

// Retention returns the configured retention, defaults filled, and false when
// Config.Retention is not set.
func (s *Store) Retention() (inbox.Retention, bool) {
	return s.cfg.Retention, s.cfg.Retention != (inbox.Retention{})
}

// purgeLockKey is hashed into the session advisory lock that makes one purger at a time per
// inbox table.
func (s *Store) purgeLockKey() string { return "watermill-inbox:purge:" + s.table }

// PurgeExpired deletes every expired row of the inbox table, its attempts table and the given
// watermill-sql topics, per table in batches of p.BatchSize rows (one transaction each,
// oldest first by the table's time column), repeating until a batch deletes fewer rows than
// its size, with p.Pause between batches:
//
//   - the inbox table: rows whose received_at is before Now - Retention.Window;
//   - the attempts table: records of messages neither processed nor dead-lettered whose
//     last_attempt_at is before the same cutoff, skipping any key a delivery holds right now
//     (its advisory lock, taken with pg_try_advisory_xact_lock, is busy): such a record is
//     the live count of an in-flight delivery;
//   - the attempts table: dead-lettered records whose dead_lettered_at is before Now -
//     Retention.DeadLetterWindow;
//   - each topic's messages table: rows at or below the committed offset of every consumer
//     group in its offsets table (watermill-sql v4 orders by transaction_id, then offset) and
//     whose created_at is before the cutoff. A topic with no consumer group, or with a group
//     whose offset is NULL, loses nothing.
//
// The windows are measured from the database's clock. Exactly one purge runs at a time per
// inbox table across every process: PurgeExpired holds a session advisory lock
// (pg_try_advisory_lock) on one pooled connection for its whole run, and returns
// ErrPurgeInProgress at once when another holds it. Errors: ErrNoRetention, ErrPurgeInProgress,
// an error wrapping inbox.ErrInvalidConfig for an invalid topic name, ctx's error (the report
// then holds what was done), or the database's, wrapped with the table.
func (s *Store) PurgeExpired(ctx context.Context, p PurgeExpiredParams) (PurgeReport, error) {
	var rep PurgeReport
	ret, ok := s.Retention()
	if !ok {
		return rep, ErrNoRetention
	}
	type topicTables struct{ messages, offsets string }
	var topics []topicTables
	for _, t := range p.Topics {
		m, o, err := t.Tables()
		if err != nil {
			return rep, err
		}
		topics = append(topics, topicTables{m, o})
	}
	size := p.BatchSize
	if size <= 0 {
		size = DefaultPurgeBatchSize
	}
	pause := p.Pause
	if pause == 0 {
		pause = DefaultPurgePause
	}
	rp := purge.Params{BatchSize: size, Pause: pause, DryRun: p.DryRun}
	if p.Progress != nil {
		rp.Progress = func(pr purge.Progress) { p.Progress(PurgeProgress(pr)) }
	}
	rep.DryRun = p.DryRun
	now, tables, err := purge.Run(ctx, s.pool, s.purgeLockKey(), rp, func(now time.Time) []purge.Step {
		cutoff, dlCutoff := now.Add(-ret.Window), now.Add(-ret.DeadLetterWindow)
		steps := []purge.Step{
			{Kind: PurgeKindInbox, Table: s.table,
				Batch: func(ctx context.Context, c *pgxpool.Conn, limit int) (int64, error) {
					return s.purgeInboxBatch(ctx, c, cutoff, limit)
				},
				Count: func(ctx context.Context, c *pgxpool.Conn) (int64, error) {
					return s.countExpiredInbox(ctx, c, cutoff)
				}},
			{Kind: PurgeKindAttempts, Table: s.attempts,
				Batch: func(ctx context.Context, c *pgxpool.Conn, limit int) (int64, error) {
					return s.purgeAttemptsBatch(ctx, c, cutoff, limit)
				},
				Count: func(ctx context.Context, c *pgxpool.Conn) (int64, error) {
					return s.countExpiredAttempts(ctx, c, cutoff)
				}},
			{Kind: PurgeKindDeadLetters, Table: s.attempts,
				Batch: func(ctx context.Context, c *pgxpool.Conn, limit int) (int64, error) {
					return s.purgeDeadLettersBatch(ctx, c, dlCutoff, limit)
				},
				Count: func(ctx context.Context, c *pgxpool.Conn) (int64, error) {
					return s.countExpiredDeadLetters(ctx, c, dlCutoff)
				}},
		}
		for _, t := range topics {
			steps = append(steps, purge.TopicStep(PurgeKindTopic, t.messages, t.offsets, cutoff))
		}
		return steps
	})
	if !now.IsZero() {
		rep.Now = now
		rep.Cutoff = now.Add(-ret.Window)
		rep.DeadLetterCutoff = now.Add(-ret.DeadLetterWindow)
	}
	for _, t := range tables {
		rep.Tables = append(rep.Tables, PurgeProgress(t))
	}
	return rep, err
}

// purgeInboxBatch deletes at most limit processed rows received before cutoff, oldest first
// (the received_at index), in one statement.
func (s *Store) purgeInboxBatch(ctx context.Context, c *pgxpool.Conn, cutoff time.Time, limit int) (int64, error) {
	where := " WHERE " + s.receivedBefore("$1") + " ORDER BY " + s.receivedColumn() + " LIMIT $2"
	var n int64
	err := c.QueryRow(ctx, s.purgeRowsSQL(where), cutoff, limit).Scan(&n)
	return n, err
}

// purgeRowsSQL deletes the inbox rows that where (a WHERE ... LIMIT clause over the inbox
// table) selects, by ctid; it returns the number of rows deleted.
func (s *Store) purgeRowsSQL(where string) string {
	match := "ctid = ANY (ARRAY(SELECT ctid FROM " + s.table + where + "))"
	if s.cfg.Partitioning != nil {
		// A ctid is unique only within one partition: name the partition too.
		match = "(tableoid, ctid) IN (SELECT tableoid, ctid FROM " + s.table + where + ")"
	}
	return "WITH gone AS (DELETE FROM " + s.table + " WHERE " + match + " RETURNING 1) SELECT count(*) FROM gone"
}

func (s *Store) countExpiredInbox(ctx context.Context, c *pgxpool.Conn, cutoff time.Time) (int64, error) {
	var n int64
	err := c.QueryRow(ctx, "SELECT count(*) FROM "+s.table+" WHERE "+s.receivedBefore("$1"), cutoff).Scan(&n)
	return n, err
}

// purgeAttemptsBatch deletes at most limit live (not dead-lettered) attempt records whose last
// attempt is before cutoff, oldest first, skipping keys whose advisory lock (the lock every
// counted delivery of the key holds: see lockKey) is taken right now, so the record of an
// in-flight delivery is never deleted. The lock is tried, never waited for, and is held only
// until the batch commits; a delivery that then counts creates a fresh record. A record
// updated after the statement's snapshot is skipped (its ctid changed and its
// last_attempt_at is recent).
func (s *Store) purgeAttemptsBatch(ctx context.Context, c *pgxpool.Conn, cutoff time.Time, limit int) (int64, error) {
	tag, err := c.Exec(ctx, "WITH expired AS (SELECT ctid, message_id, consumer_name FROM "+s.attempts+
		" WHERE dead_lettered_at IS NULL AND last_attempt_at < $1 ORDER BY last_attempt_at LIMIT $2),"+
		" free AS MATERIALIZED (SELECT ctid FROM expired"+
		" WHERE pg_try_advisory_xact_lock(hashtextextended($3::text || chr(31) || consumer_name || chr(31) || message_id, 0)))"+
		" DELETE FROM "+s.attempts+" WHERE ctid IN (SELECT ctid FROM free) AND dead_lettered_at IS NULL AND last_attempt_at < $1",
		cutoff, limit, s.table)
	return tag.RowsAffected(), err
}

func (s *Store) countExpiredAttempts(ctx context.Context, c *pgxpool.Conn, cutoff time.Time) (int64, error) {
	var n int64
	err := c.QueryRow(ctx, "SELECT count(*) FROM "+s.attempts+" WHERE dead_lettered_at IS NULL AND last_attempt_at < $1", cutoff).Scan(&n)
	return n, err
}

// purgeDeadLettersBatch deletes at most limit dead-lettered records dead-lettered before
// cutoff, oldest first (the partial dead_lettered_at index).
func (s *Store) purgeDeadLettersBatch(ctx context.Context, c *pgxpool.Conn, cutoff time.Time, limit int) (int64, error) {
	tag, err := c.Exec(ctx, "DELETE FROM "+s.attempts+" WHERE ctid = ANY (ARRAY(SELECT ctid FROM "+s.attempts+
		" WHERE dead_lettered_at < $1 ORDER BY dead_lettered_at LIMIT $2)) AND dead_lettered_at < $1", cutoff, limit)
	return tag.RowsAffected(), err
}

func (s *Store) countExpiredDeadLetters(ctx context.Context, c *pgxpool.Conn, cutoff time.Time) (int64, error) {
	var n int64
	err := c.QueryRow(ctx, "SELECT count(*) FROM "+s.attempts+" WHERE dead_lettered_at < $1", cutoff).Scan(&n)
	return n, err
}
