package deferred

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/purge"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// PurgeKindDone is the pgstore.PurgeProgress Kind of the store-then-process table's purge:
// done rows whose done_at is older than the retention window.
const PurgeKindDone = "deferred_done"

// Retention implements inbox.RetentionStore: Config.Retention with defaults filled, and false
// when it is not set.
func (i *Inbox) Retention() (inbox.Retention, bool) {
	return i.cfg.Retention, i.cfg.Retention != (inbox.Retention{})
}

// purgeLockKey names the session advisory lock that makes one purger at a time per table and
// consumer (purges of different consumers delete disjoint rows and may run together).
func (i *Inbox) purgeLockKey() string {
	return "watermill-inbox:deferred-purge:" + i.n.qtable + ":" + i.cfg.ConsumerName
}

// expiredDoneSQL selects the consumer's ($2) done rows whose done_at is before the cutoff ($1)
// that may go. A row with a producer sequence (OrderProducerSequence) is kept unless a row of
// its aggregate with the next sequence number exists, and every such row is done before the
// cutoff too: the claim's predecessor probe reads the row with sequence s-1 of a head row s,
// so the row before an unfinished one (pending, processing, dead: replayable), the row before
// a gap (a late message will need it), each aggregate's latest row, and the row before one
// done inside the window (which Replay may reset) all stay. Every other done row before the
// cutoff goes. The done_at partial index orders the scan; the predecessor index serves the
// probes.
func (i *Inbox) expiredDoneSQL(cols string) string {
	t := i.n.qtable
	return `SELECT ` + cols + ` FROM ` + t + ` d
WHERE d.status = 'done' AND d.done_at < $1 AND d.consumer_name = $2
  AND (d.producer_seq IS NULL OR d.aggregate_key IS NULL OR (
    EXISTS (SELECT 1 FROM ` + t + ` n
            WHERE n.consumer_name = d.consumer_name AND n.aggregate_key = d.aggregate_key
              AND n.producer_seq = d.producer_seq + 1)
    AND NOT EXISTS (SELECT 1 FROM ` + t + ` n
            WHERE n.consumer_name = d.consumer_name AND n.aggregate_key = d.aggregate_key
              AND n.producer_seq = d.producer_seq + 1 AND (n.status <> 'done' OR n.done_at >= $1))))`
}

// PurgeExpired deletes the consumer's done rows whose done_at is before Now -
// Retention.Window (database clock), oldest first, in batches of p.BatchSize rows (default
// pgstore.DefaultPurgeBatchSize; one transaction each) with p.Pause between batches (default
// pgstore.DefaultPurgePause; negative: none), until a batch deletes fewer rows than its size;
// then the consumed rows of p.Topics older than the window, as pgstore.Store.PurgeExpired
// does. p.DryRun counts and deletes nothing; p.Progress is called after every batch (Kind
// PurgeKindDone, then pgstore.PurgeKindTopic).
//
// Pending, processing and dead rows are never deleted, whatever their age. With producer
// sequences, a done row the predecessor probe may still read is kept (see expiredDoneSQL and
// docs/store-then-process.md, "Retention"). A row replayed while the purge runs is not
// deleted (each DELETE rechecks status and done_at on the row's latest version).
//
// Exactly one purge runs at a time per table and consumer across every process (a session
// advisory lock held for the whole run); workers and receipts go on meanwhile (a batch locks
// only the done rows it deletes, which no claim reads). The report's DeadLetterCutoff is zero:
// dead rows are not purged by age. Errors: pgstore.ErrNoRetention (wrapping
// inbox.ErrInvalidConfig) without Config.Retention, pgstore.ErrPurgeInProgress when another
// purge holds the lock, an error wrapping inbox.ErrInvalidConfig for an invalid topic name,
// ctx's error (the report then holds what was done), or the database's, wrapped with the table.
func (i *Inbox) PurgeExpired(ctx context.Context, p pgstore.PurgeExpiredParams) (pgstore.PurgeReport, error) {
	var rep pgstore.PurgeReport
	ret, ok := i.Retention()
	if !ok {
		return rep, pgstore.ErrNoRetention
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
	rp := purge.Params{BatchSize: p.BatchSize, Pause: p.Pause, DryRun: p.DryRun}
	if rp.BatchSize <= 0 {
		rp.BatchSize = pgstore.DefaultPurgeBatchSize
	}
	if rp.Pause == 0 {
		rp.Pause = pgstore.DefaultPurgePause
	}
	if p.Progress != nil {
		rp.Progress = func(pr purge.Progress) { p.Progress(pgstore.PurgeProgress(pr)) }
	}
	rep.DryRun = p.DryRun
	deleteSQL := "DELETE FROM " + i.n.qtable + " WHERE id = ANY (ARRAY(" + i.expiredDoneSQL("d.id") +
		" ORDER BY d.done_at LIMIT $3)) AND status = 'done' AND done_at < $1"
	countSQL := i.expiredDoneSQL("count(*)")
	consumer := i.cfg.ConsumerName
	now, tables, err := purge.Run(ctx, i.cfg.Pool, i.purgeLockKey(), rp, func(now time.Time) []purge.Step {
		cutoff := now.Add(-ret.Window)
		steps := []purge.Step{{Kind: PurgeKindDone, Table: i.n.qtable,
			Batch: func(ctx context.Context, c *pgxpool.Conn, limit int) (int64, error) {
				tag, err := c.Exec(ctx, deleteSQL, cutoff, consumer, limit)
				return tag.RowsAffected(), err
			},
			Count: func(ctx context.Context, c *pgxpool.Conn) (int64, error) {
				var n int64
				err := c.QueryRow(ctx, countSQL, cutoff, consumer).Scan(&n)
				return n, err
			}}}
		for _, t := range topics {
			steps = append(steps, purge.TopicStep(pgstore.PurgeKindTopic, t.messages, t.offsets, cutoff))
		}
		return steps
	})
	if !now.IsZero() {
		rep.Now, rep.Cutoff = now, now.Add(-ret.Window)
	}
	for _, t := range tables {
		rep.Tables = append(rep.Tables, pgstore.PurgeProgress(t))
	}
	return rep, err
}
