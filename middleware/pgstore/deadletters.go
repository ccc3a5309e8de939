package pgstore

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// The operator's view of dead letters: list them, group them by reason, discard them. Each
// statement is one file under queries/ (queries.go).

// deadLetterSQL returns the statement of queries/<name>.sql for s.
func (s *Store) deadLetterSQL(name string) string { return renderQuery(name, s.names).sql }

// DeadLetterRecord is one dead-lettered attempt record.
type DeadLetterRecord struct {
	// MessageID is the key (the message UUID, or the business key the inbox was keyed by).
	MessageID string `json:"message_id"`
	// ConsumerName is the consumer whose inbox dead-lettered it.
	ConsumerName string `json:"consumer_name"`
	// Attempts is the message's durable attempt count (handler runs counted).
	Attempts int `json:"attempts"`
	// Reason is the stored dead-letter reason ("" when none was stored).
	Reason string `json:"reason"`
	// LastError is the last handler error, truncated to 1 KiB; never a payload.
	LastError string `json:"last_error,omitempty"`
	// DeadLettered is when it was dead-lettered (dead_lettered_at, the database's clock).
	DeadLettered time.Time `json:"dead_lettered_at"`
}

// DeadLetterFilter selects dead-lettered records for DeadLetters, DeadLetterReasons and
// DiscardDeadLetters. The zero value selects every record.
type DeadLetterFilter struct {
	// ConsumerName, when non-empty, selects one consumer.
	ConsumerName string
	// Reason, when non-empty, selects records whose dead-letter reason is exactly this text
	// (as DeadLetterRecord.Reason and DeadLetterReason.Reason print it).
	Reason string
	// Since, when non-zero, selects records dead-lettered at or after it.
	Since time.Time
	// Until, when non-zero, selects records dead-lettered before it.
	Until time.Time
	// MessageID, when non-empty, selects one key.
	MessageID string
	// Limit bounds the records returned or discarded (DeadLetterReasons: the groups
	// returned), oldest first; zero or negative means no limit.
	Limit int
}

// args returns f as the queries' parameters $1 to $6: NULL for every unset field.
func (f DeadLetterFilter) args() []any {
	str := func(v string) any {
		if v == "" {
			return nil
		}
		return v
	}
	ts := func(t time.Time) any {
		if t.IsZero() {
			return nil
		}
		return t
	}
	var limit any
	if f.Limit > 0 {
		limit = f.Limit
	}
	return []any{str(f.ConsumerName), str(f.Reason), ts(f.Since), ts(f.Until), str(f.MessageID), limit}
}

// DeadLetters lists the dead-lettered records f selects, oldest first. Errors are the
// database's, wrapped.
func (s *Store) DeadLetters(ctx context.Context, f DeadLetterFilter) ([]DeadLetterRecord, error) {
	rows, err := s.pool.Query(ctx, s.deadLetterSQL("dead_letters_list"), f.args()...)
	if err != nil {
		return nil, fmt.Errorf("dead letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadLetterRecord, error) {
		var d DeadLetterRecord
		var attempts int32
		err := r.Scan(&d.MessageID, &d.ConsumerName, &attempts, &d.Reason, &d.LastError, &d.DeadLettered)
		d.Attempts = int(attempts)
		return d, err
	})
	if err != nil {
		return nil, fmt.Errorf("dead letters: %w", err)
	}
	return out, nil
}

// DeadLetterReason is one group of dead-lettered records: one consumer, one reason.
type DeadLetterReason struct {
	// ConsumerName is the consumer whose inbox dead-lettered them.
	ConsumerName string `json:"consumer_name"`
	// Reason is the stored dead-letter reason ("" when none was stored).
	Reason string `json:"reason"`
	// Count is the number of records in the group.
	Count int64 `json:"count"`
	// FirstSeen and LastSeen are the earliest and the latest time one of them was
	// dead-lettered.
	FirstSeen time.Time `json:"first_seen"`
	LastSeen  time.Time `json:"last_seen"`
}

// DeadLetterReasons groups the dead-lettered records f selects by consumer and reason, the
// group first seen first (f.Limit bounds the groups). It reads the attempts table only, one
// statement. Errors are the database's, wrapped.
func (s *Store) DeadLetterReasons(ctx context.Context, f DeadLetterFilter) ([]DeadLetterReason, error) {
	rows, err := s.pool.Query(ctx, s.deadLetterSQL("dead_letters_by_reason"), f.args()...)
	if err != nil {
		return nil, fmt.Errorf("dead letters by reason: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadLetterReason, error) {
		var g DeadLetterReason
		err := r.Scan(&g.ConsumerName, &g.Reason, &g.Count, &g.FirstSeen, &g.LastSeen)
		return g, err
	})
	if err != nil {
		return nil, fmt.Errorf("dead letters by reason: %w", err)
	}
	return out, nil
}

// DiscardDeadLetters deletes the dead-lettered records f selects (f.Limit, when positive,
// bounds them, oldest first), DiscardBatchSize per transaction, and returns how many it
// deleted. It does to them now what PurgeExpired does once the dead-letter window has passed:
// the key is no longer dead-lettered, so a copy delivered later runs the handler as a new
// message (and, if it fails again, is dead-lettered again). Use it for dead letters nobody
// will replay, after dropping them from the dead-letter topic. On an error (the database's,
// wrapped; or ctx's), the count holds the records deleted by the batches that committed.
func (s *Store) DiscardDeadLetters(ctx context.Context, f DeadLetterFilter) (int64, error) {
	q := s.deadLetterSQL("dead_letters_discard")
	var total int64
	for {
		batch := DiscardBatchSize
		if f.Limit > 0 {
			batch = min(batch, f.Limit-int(total))
		}
		if batch <= 0 {
			return total, nil
		}
		b := f
		b.Limit = batch
		var n int64
		if err := s.pool.QueryRow(ctx, q, b.args()...).Scan(&n); err != nil {
			return total, fmt.Errorf("discard dead letters: %w", err)
		}
		total += n
		if n < int64(batch) {
			return total, nil
		}
	}
}
