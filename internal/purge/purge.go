// Package purge runs a retention purge: the loop shared by the immediate inbox's purge
// (pgstore.Store.PurgeExpired) and the store-then-process inbox's (deferred.Inbox.PurgeExpired).
// One session advisory lock per purge target makes exactly one purger at a time; each table is
// purged in bounded batches (one transaction each) with a pause between them, until a batch
// deletes fewer rows than its size; a dry run counts instead. It also holds the purge of
// watermill-sql topic tables, which both inboxes offer. docs/retention.md describes the rules.
package purge

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrInProgress is returned by Run when another session holds the target's purge lock.
// pgstore.ErrPurgeInProgress is this error.
var ErrInProgress = errors.New("pgstore: another purge of this inbox table is running")

// Step is one table's part of a purge.
type Step struct {
	// Kind names what is purged (a PurgeKind constant of pgstore or deferred); Table is the
	// quoted table name, for reports.
	Kind, Table string
	// Batch deletes at most limit expired rows in one statement (its own transaction) on c
	// and returns how many it deleted.
	Batch func(ctx context.Context, c *pgxpool.Conn, limit int) (int64, error)
	// Count returns how many rows Batch would delete in all (dry run).
	Count func(ctx context.Context, c *pgxpool.Conn) (int64, error)
}

// Progress reports one table's progress; pgstore.PurgeProgress has the same fields and
// converts from it.
type Progress struct {
	// Kind and Table are the Step's.
	Kind, Table string
	// Rows deleted so far (in a dry run: rows that would be deleted).
	Rows int64
	// Batches run so far (0 in a dry run).
	Batches int
	// Done is true on a table's last report.
	Done bool
}

// Params are Run's settings.
type Params struct {
	// BatchSize bounds the rows deleted per transaction (at least 1).
	BatchSize int
	// Pause is slept between two batches; zero or negative: none.
	Pause time.Duration
	// DryRun counts with each Step's Count and deletes nothing.
	DryRun bool
	// Progress, when set, is called after every batch (once per table in a dry run).
	Progress func(Progress)
}

// Run takes the session advisory lock named lockKey (pg_try_advisory_lock of
// hashtextextended(lockKey, 0)) on one connection of pool, held for the whole run and released
// at the end (or with the session, when the unlock fails), reads the database clock, and runs
// the steps that steps(now) returns, in order, on that connection. It returns the database
// time, one Progress per table run (each Done unless an error stopped it) and: ErrInProgress
// when the lock is taken (nothing ran), ctx's error when cancelled during a pause, or the
// database's error wrapped with the table.
func Run(ctx context.Context, pool *pgxpool.Pool, lockKey string, p Params, steps func(now time.Time) []Step) (now time.Time, tables []Progress, err error) {
	if p.BatchSize < 1 {
		return now, nil, fmt.Errorf("purge: batch size %d, want at least 1", p.BatchSize)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return now, nil, fmt.Errorf("purge: acquire a connection: %w", err)
	}
	var locked bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock(hashtextextended($1, 0)), now()", lockKey).Scan(&locked, &now); err != nil {
		conn.Release()
		return time.Time{}, nil, fmt.Errorf("purge: take the purge lock: %w", err)
	}
	if !locked {
		conn.Release()
		return time.Time{}, nil, ErrInProgress
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if _, err := conn.Exec(uctx, "SELECT pg_advisory_unlock(hashtextextended($1, 0))", lockKey); err != nil {
			_ = conn.Conn().Close(uctx) // the lock goes with the session
		}
		conn.Release()
	}()
	for _, st := range steps(now) {
		pr := Progress{Kind: st.Kind, Table: st.Table}
		if p.DryRun {
			n, err := st.Count(ctx, conn)
			if err != nil {
				return now, tables, fmt.Errorf("purge %s (dry run): %w", st.Table, err)
			}
			pr.Rows, pr.Done = n, true
			tables = append(tables, pr)
			if p.Progress != nil {
				p.Progress(pr)
			}
			continue
		}
		for {
			n, err := st.Batch(ctx, conn, p.BatchSize)
			if err != nil {
				tables = append(tables, pr)
				return now, tables, fmt.Errorf("purge %s: %w", st.Table, err)
			}
			pr.Rows += n
			pr.Batches++
			pr.Done = n < int64(p.BatchSize)
			if p.Progress != nil {
				p.Progress(pr)
			}
			if pr.Done {
				break
			}
			if p.Pause > 0 {
				select {
				case <-time.After(p.Pause):
				case <-ctx.Done():
					tables = append(tables, pr)
					return now, tables, ctx.Err()
				}
			}
		}
		tables = append(tables, pr)
	}
	return now, tables, nil
}

// topicConsumedSQL selects the rows of a watermill-sql v4 messages table (m) that every consumer
// group has consumed: watermill-sql reads a group's rows in (transaction_id, "offset") order
// and commits (last_processed_transaction_id, offset_acked), so a row at or below the least
// committed position of all groups is consumed by all. No group, or a group with a NULL
// offset, selects nothing. created_at is watermill-sql's TIMESTAMP (without time zone, written
// as CURRENT_TIMESTAMP in the session's TimeZone): $1 is converted the same way.
const topicConsumedSQL = `WITH pos AS (
	SELECT last_processed_transaction_id AS x, offset_acked AS o FROM %[2]s
	WHERE NOT EXISTS (SELECT 1 FROM %[2]s WHERE offset_acked IS NULL)
	ORDER BY 1, 2 LIMIT 1)
SELECT m.transaction_id, m."offset" FROM %[1]s m, pos
WHERE (m.transaction_id, m."offset") <= (pos.x, pos.o) AND m.created_at < ($1::timestamptz)::timestamp`

// TopicStep purges a watermill-sql (v4) messages table (messages, quoted) of the rows every
// consumer group in its offsets table (offsets, quoted) has consumed and that were created
// before cutoff, in (transaction_id, "offset") order (its primary key). kind is the caller's
// name for it.
func TopicStep(kind, messages, offsets string, cutoff time.Time) Step {
	return Step{Kind: kind, Table: messages,
		Batch: func(ctx context.Context, c *pgxpool.Conn, limit int) (int64, error) {
			tag, err := c.Exec(ctx, "DELETE FROM "+messages+` WHERE (transaction_id, "offset") IN (`+
				fmt.Sprintf(topicConsumedSQL, messages, offsets)+` ORDER BY m.transaction_id, m."offset" LIMIT $2)`, cutoff, limit)
			return tag.RowsAffected(), err
		},
		Count: func(ctx context.Context, c *pgxpool.Conn) (int64, error) {
			var n int64
			err := c.QueryRow(ctx, "SELECT count(*) FROM ("+fmt.Sprintf(topicConsumedSQL, messages, offsets)+") AS consumed", cutoff).Scan(&n)
			return n, err
		}}
}
