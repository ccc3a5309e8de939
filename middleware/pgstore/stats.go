package pgstore

import (
	"context"
	"fmt"
	"time"
)

// TableStats describes the inbox table and its attempts table, for operators (the CLI's
// stats command) and for sizing the retention window (docs/retention.md).
type TableStats struct {
	// Table and AttemptsTable are the quoted table names.
	Table         string `json:"table"`
	AttemptsTable string `json:"attempts_table"`
	// Rows is the exact number of processed rows (count(*)).
	Rows int64 `json:"rows"`
	// HeapBytes is pg_table_size (heap, TOAST, free space and visibility maps) and
	// IndexBytes pg_indexes_size, summed over every partition when the table is partitioned.
	HeapBytes  int64 `json:"heap_bytes"`
	IndexBytes int64 `json:"index_bytes"`
	// BytesPerRow is (HeapBytes + IndexBytes) / Rows; 0 for an empty table. Dead tuples not
	// yet vacuumed count in the bytes: VACUUM first for a fair figure.
	BytesPerRow float64 `json:"bytes_per_row"`
	// Oldest and Newest are the least and greatest time a row was received (in the compact
	// layout, to the minute: the start of the minute received_minute holds); nil for an
	// empty table.
	Oldest *time.Time `json:"oldest,omitempty"`
	Newest *time.Time `json:"newest,omitempty"`
	// PerConsumer counts processed rows by consumer name.
	PerConsumer map[string]int64 `json:"per_consumer"`
	// AttemptsPending counts attempt records of messages neither processed nor
	// dead-lettered; DeadLettered counts dead-lettered records.
	AttemptsPending int64 `json:"attempts_pending"`
	DeadLettered    int64 `json:"dead_lettered"`
	// AttemptsHeapBytes and AttemptsIndexBytes size the attempts table.
	AttemptsHeapBytes  int64 `json:"attempts_heap_bytes"`
	AttemptsIndexBytes int64 `json:"attempts_index_bytes"`
	// DuplicateAges is each consumer's duplicate-age histogram (Store.DuplicateAges), by
	// consumer name; a consumer without duplicates has no entry.
	DuplicateAges map[string]DuplicateAges `json:"duplicate_ages"`
}

// relSizeSQL sums pg_table_size and pg_indexes_size over a table's partition tree (the table
// itself when it is not partitioned).
const relSizeSQL = "SELECT coalesce(sum(pg_table_size(relid)), 0)::bigint, coalesce(sum(pg_indexes_size(relid)), 0)::bigint" +
	" FROM (SELECT relid FROM pg_partition_tree($1::regclass) UNION SELECT $1::regclass) AS tree(relid)"

// Stats reads the table statistics and the duplicate-age histograms. It scans the inbox table
// (count(*), min, max, group by consumer), so on a large table it costs what a sequential scan
// costs. Errors are the database's, wrapped.
func (s *Store) Stats(ctx context.Context) (TableStats, error) {
	st := TableStats{Table: s.table, AttemptsTable: s.attempts, PerConsumer: map[string]int64{}}
	if err := s.pool.QueryRow(ctx, relSizeSQL, s.table).Scan(&st.HeapBytes, &st.IndexBytes); err != nil {
		return st, fmt.Errorf("stats: size of %s: %w", s.table, err)
	}
	if err := s.pool.QueryRow(ctx, relSizeSQL, s.attempts).Scan(&st.AttemptsHeapBytes, &st.AttemptsIndexBytes); err != nil {
		return st, fmt.Errorf("stats: size of %s: %w", s.attempts, err)
	}
	perConsumer := "SELECT consumer_name, count(*), min(received_at), max(received_at) FROM " + s.table + " GROUP BY consumer_name"
	if s.cfg.Layout == LayoutCompact {
		// The compact layout keeps a smallint per row (the names are in the consumers table)
		// and the minute it was received.
		perConsumer = "SELECT c.consumer_name, count(*), to_timestamp(min(t.received_minute) * 60::float8), to_timestamp(max(t.received_minute) * 60::float8) FROM " + s.table +
			" t JOIN " + s.consumers + " c USING (consumer_id) GROUP BY c.consumer_name"
	}
	rows, err := s.pool.Query(ctx, perConsumer)
	if err != nil {
		return st, fmt.Errorf("stats: rows of %s: %w", s.table, err)
	}
	for rows.Next() {
		var name string
		var n int64
		var lo, hi time.Time
		if err := rows.Scan(&name, &n, &lo, &hi); err != nil {
			rows.Close()
			return st, fmt.Errorf("stats: %w", err)
		}
		st.PerConsumer[name] = n
		st.Rows += n
		if st.Oldest == nil || lo.Before(*st.Oldest) {
			st.Oldest = &lo
		}
		if st.Newest == nil || hi.After(*st.Newest) {
			st.Newest = &hi
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return st, fmt.Errorf("stats: rows of %s: %w", s.table, err)
	}
	if st.Rows > 0 {
		st.BytesPerRow = float64(st.HeapBytes+st.IndexBytes) / float64(st.Rows)
	}
	err = s.pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE dead_lettered_at IS NULL), count(*) FILTER (WHERE dead_lettered_at IS NOT NULL) FROM "+s.attempts).
		Scan(&st.AttemptsPending, &st.DeadLettered)
	if err != nil {
		return st, fmt.Errorf("stats: %s: %w", s.attempts, err)
	}
	if st.DuplicateAges, err = s.DuplicateAges(ctx); err != nil {
		return st, fmt.Errorf("stats: %w", err)
	}
	return st, nil
}
