package outbox

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"
)

// RelayStats are a relay's counters since NewRelay, read by Relay.Stats without touching the
// database. Counters only grow; InFlight is a gauge.
type RelayStats struct {
	// Relayed is the number of messages published whose rows' offset was then committed
	// (messages published in a batch that was rolled back are not counted; they are
	// published again).
	Relayed int64
	// Batches is the number of committed relay transactions that published or skipped at
	// least one row.
	Batches int64
	// FailedBatches is the number of relay transactions rolled back after publishing (a
	// publish the broker refused, a failed COMMIT): their rows are published again.
	FailedBatches int64
	// MalformedSkipped is the number of rows acknowledged without a publish because the relay
	// could not read them (see MalformedRow).
	MalformedSkipped int64
	// InFlight is the number of publishes started and not yet answered by the broker, at most
	// RelayConfig.MaxInFlight.
	InFlight int64
}

type relayCounters struct {
	relayed, batches, failedBatches, malformed, inFlight atomic.Int64
}

// Stats returns the relay's counters. It is cheap (atomic loads) and safe for concurrent use;
// export them as metrics (counters: Relayed, Batches, FailedBatches, MalformedSkipped; gauge:
// InFlight).
func (r *Relay) Stats() RelayStats {
	return RelayStats{
		Relayed:          r.stats.relayed.Load(),
		Batches:          r.stats.batches.Load(),
		FailedBatches:    r.stats.failedBatches.Load(),
		MalformedSkipped: r.stats.malformed.Load(),
		InFlight:         r.stats.inFlight.Load(),
	}
}

// RelayBatch describes one relay transaction, for RelayConfig.OnBatch.
type RelayBatch struct {
	// Published is the number of messages the broker confirmed in this transaction.
	Published int
	// Skipped is the number of malformed rows acknowledged without a publish.
	Skipped int
	// Committed is true when the consumer group's offset was stored; false when the
	// transaction was rolled back and its rows will be published again.
	Committed bool
	// Duration is the time from BEGIN to the end of COMMIT or ROLLBACK.
	Duration time.Duration
}

// RelayLag is how far a consumer group of the outbox is behind, as read by Relay.Lag.
type RelayLag struct {
	// Pending is the number of rows after the group's committed offset: written, not yet
	// relayed (rows of transactions still open are counted once committed).
	Pending int64
	// OldestAge is the age of the oldest pending row (now minus its created_at), 0 when none
	// is pending. The relay's latency: it grows when the relay falls behind.
	OldestAge time.Duration
	// OffsetGap is the highest offset in the table minus the group's acknowledged offset
	// (0 when the group is caught up). Offsets are assigned when rows are inserted, not when
	// they commit, so it is an estimate; Pending is exact.
	OffsetGap int64
}

// Lag reads the relay's consumer group's backlog from the database: one statement on the
// outbox and offsets tables, scanning only the pending rows (on PostgreSQL an index range on
// the table's primary key (transaction_id, "offset"); on MySQL the queue's rows, which are
// only the pending ones, with OldestAge in whole seconds). Call it as often as a metrics scrape; its cost grows with
// the backlog, not with the table. A group that never ran counts every row as pending.
// Errors are the driver's, wrapped.
func (r *Relay) Lag(ctx context.Context) (RelayLag, error) {
	if r.cfg.MySQL != nil {
		return r.mysqlLag(ctx)
	}
	msgs, offs := r.cfg.MessagesTable(), r.cfg.OffsetsTable()
	q := `WITH g AS (
		SELECT coalesce((SELECT offset_acked FROM ` + offs + ` WHERE consumer_group = $1), 0) AS offset_acked,
		       coalesce((SELECT last_processed_transaction_id FROM ` + offs + ` WHERE consumer_group = $1), '0'::xid8) AS tx
	), p AS (
		SELECT m."offset", m.created_at FROM ` + msgs + ` m, g
		WHERE (m.transaction_id = g.tx AND m."offset" > g.offset_acked) OR m.transaction_id > g.tx
	)
	SELECT (SELECT count(*) FROM p),
	       coalesce((SELECT extract(epoch FROM localtimestamp - min(created_at)) FROM p), 0)::float8,
	       greatest(coalesce((SELECT max("offset") FROM ` + msgs + `), 0) - (SELECT offset_acked FROM g), 0)`
	var lag RelayLag
	var age float64
	if err := r.cfg.Pool.QueryRow(ctx, q, r.cfg.ConsumerGroup).Scan(&lag.Pending, &age, &lag.OffsetGap); err != nil {
		return RelayLag{}, fmt.Errorf("outbox relay: reading the lag of consumer group %q: %w", r.cfg.ConsumerGroup, err)
	}
	if age > 0 && lag.Pending > 0 {
		lag.OldestAge = time.Duration(age * float64(time.Second))
	}
	return lag, nil
}
