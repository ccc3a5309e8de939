package inboxmetrics

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/watermill-inbox/internal/ident"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// Defaults for TableConfig.
const (
	// DefaultScrapeTimeout bounds the collector's queries per scrape.
	DefaultScrapeTimeout = 5 * time.Second
	// DefaultCountCap caps the exact counts (attempts pending, dead-lettered rows, outbox
	// backlog): each reads at most this many rows per scrape, so a scrape stays cheap whatever
	// the table holds; a gauge equal to the cap means "at least the cap".
	DefaultCountCap = 10000
)

// Querier is what the table collector queries through: *pgxpool.Pool, *pgx.Conn.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// OutboxTables names the outbox whose backlog the table collector reports (watermill-sql's
// tables of the outbox topic, as written by middleware/outbox).
type OutboxTables struct {
	// Schema of the outbox tables; "" means the connection's search_path, as in
	// outbox.Config.
	Schema string
	// Topic is the outbox topic (outbox.Config.Topic); "" means outbox.DefaultTopic,
	// "inbox_outbox".
	Topic string
	// ConsumerGroup is the relay's consumer group (outbox.RelayConfig.ConsumerGroup).
	ConsumerGroup string
}

// QueryGauge is one extra gauge the table collector reads per scrape with a query of your own
// that returns a single numeric value (e.g. the depth of a store-then-process queue). It is
// the hook for gauges of tables this package does not know.
type QueryGauge struct {
	// Name is the metric's full name (it should start with "watermill_inbox_" and end with
	// its unit, e.g. "_rows" or "_seconds").
	Name string
	// Help is the metric's description.
	Help string
	// ConstLabels are the metric's labels (bounded values only).
	ConstLabels prometheus.Labels
	// SQL returns one row with one column convertible to float64 (NULL is reported as 0).
	// Quote any identifier it names (pgx.Identifier.Sanitize).
	SQL string
	// Args are SQL's arguments.
	Args []any
}

// TableConfig configures NewTableCollector. The zero value is ready to use.
type TableConfig struct {
	// Querier overrides the store's pool.
	Querier Querier
	// Outbox, when set, adds the outbox backlog gauges.
	Outbox *OutboxTables
	// Extra gauges, read after the built-in ones in the same scrape.
	Extra []QueryGauge
	// ScrapeTimeout bounds the queries of one scrape. Default: DefaultScrapeTimeout.
	ScrapeTimeout time.Duration
	// CountCap caps each exact count. Default: DefaultCountCap.
	CountCap int
}

// TableCollector is a prometheus.Collector reporting the size and state of the inbox tables of
// one pgstore.Store, and optionally of an outbox, on every scrape. Row counts and sizes are the
// catalog's estimates (pg_class.reltuples, pg_relation_size, pg_indexes_size), which
// PostgreSQL updates on VACUUM and ANALYZE (autovacuum), never a count(*) of the inbox table;
// the oldest row's age reads the first entry of the received_at index; the attempt and outbox
// counts are exact but capped (TableConfig.CountCap), as these tables normally hold only
// messages in flight. With a retention window configured (pgstore.Config.Retention) it reports
// the window, and on a partitioned table the lead of its newest partition (read with
// pgstore.Store.Partitions, through the store's pool), so an alert can compare the oldest row
// with the window and see the partitions running out. A failed scrape reports
// watermill_inbox_table_stats_up 0 and nothing else for that table, so the rest of the
// registry still scrapes.
type TableCollector struct {
	q                                     Querier
	cfg                                   TableConfig
	store                                 *pgstore.Store
	window                                time.Duration // the store's retention window; 0 without one
	partitioned                           bool
	table, attempts, label                string
	receivedAt                            string // the store's SQL for a row's received time
	msgs, offsets, outboxLabel            string
	up, rows, heap, index, perRow, oldest *prometheus.Desc
	pending, dead                         *prometheus.Desc
	retention, lead                       *prometheus.Desc
	backlog, backlogAge                   *prometheus.Desc
	extra                                 []*prometheus.Desc
}

// NewTableCollector returns the collector for store's tables (store.Table() and
// store.AttemptsTable()). Register it on your registry. It returns an error for a nil store,
// an invalid outbox schema or topic (pgstore.ValidateIdentifier), or an extra gauge without a
// name or SQL.
func NewTableCollector(store *pgstore.Store, cfg TableConfig) (*TableCollector, error) {
	if store == nil {
		return nil, errors.New("inboxmetrics: nil store")
	}
	if cfg.Querier == nil {
		cfg.Querier = store.Pool()
	}
	if cfg.ScrapeTimeout <= 0 {
		cfg.ScrapeTimeout = DefaultScrapeTimeout
	}
	if cfg.CountCap <= 0 {
		cfg.CountCap = DefaultCountCap
	}
	sc := store.Config()
	c := &TableCollector{q: cfg.Querier, cfg: cfg, store: store, table: store.Table(), attempts: store.AttemptsTable(), label: sc.Schema + "." + sc.Table,
		receivedAt: store.ReceivedAtSQL(), partitioned: sc.Partitioning != nil}
	if r, ok := store.Retention(); ok {
		c.window = r.Window
	}
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(Namespace, "", name), help, labels, nil)
	}
	c.up = d("table_stats_up", "1 if the last scrape of the inbox table statistics succeeded, else 0.", "table")
	c.rows = d("table_rows", "Estimated rows in the inbox table (pg_class.reltuples; updated by VACUUM and ANALYZE).", "table")
	c.heap = d("table_heap_bytes", "Size of the inbox table's heap (pg_relation_size, main fork).", "table")
	c.index = d("table_index_bytes", "Size of the inbox table's indexes (pg_indexes_size).", "table")
	c.perRow = d("table_bytes_per_row", "Heap and index bytes per estimated row.", "table")
	c.oldest = d("table_oldest_row_age_seconds", "Age of the oldest processed-message row (now - min(received_at)); 0 when empty.", "table")
	c.pending = d("attempts_pending_rows", "Messages with failed or unsettled attempts that are not dead-lettered (exact, capped at the count cap).", "table")
	c.dead = d("dead_lettered_rows", "Messages in the dead-lettered state, awaiting replay (exact, capped at the count cap).", "table")
	c.retention = d("retention_window_seconds", "The store's retention window (pgstore.Config.Retention.Window), in seconds; absent without one.", "table")
	c.lead = d("partition_lead_seconds", "Seconds from now to the end of the newest partition's range (negative once it has passed); partitioned tables only.", "table")
	if o := cfg.Outbox; o != nil {
		topic := o.Topic
		if topic == "" {
			topic = "inbox_outbox"
		}
		if err := ident.Validate("inboxmetrics: outbox topic", topic, 63-len("watermill_offsets_")); err != nil {
			return nil, err
		}
		quote := func(t string) string { return pgx.Identifier{t}.Sanitize() }
		if o.Schema != "" {
			if err := ident.Validate("inboxmetrics: outbox schema", o.Schema, 63); err != nil {
				return nil, err
			}
			quote = func(t string) string { return pgx.Identifier{o.Schema, t}.Sanitize() }
		}
		c.msgs, c.offsets, c.outboxLabel = quote("watermill_"+topic), quote("watermill_offsets_"+topic), topic
		c.backlog = d("outbox_backlog_rows", "Outbox rows committed and not yet relayed for the relay's consumer group (exact, capped at the count cap).", "outbox")
		c.backlogAge = d("outbox_oldest_unrelayed_age_seconds", "Age of the oldest outbox row not yet relayed (the relay's lag behind the outbox); 0 when none.", "outbox")
	}
	for _, g := range cfg.Extra {
		if g.Name == "" || g.SQL == "" {
			return nil, errors.New("inboxmetrics: an extra QueryGauge needs a Name and SQL")
		}
		c.extra = append(c.extra, prometheus.NewDesc(g.Name, g.Help, nil, g.ConstLabels))
	}
	return c, nil
}

// Describe implements prometheus.Collector.
func (c *TableCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.up, c.rows, c.heap, c.index, c.perRow, c.oldest, c.pending, c.dead, c.retention, c.lead} {
		ch <- d
	}
	if c.backlog != nil {
		ch <- c.backlog
		ch <- c.backlogAge
	}
	for _, d := range c.extra {
		ch <- d
	}
}

// Collect implements prometheus.Collector: one query for the inbox tables, one for the
// outbox, one per extra gauge, all within ScrapeTimeout.
func (c *TableCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.ScrapeTimeout)
	defer cancel()
	s, err := c.Read(ctx)
	if err != nil {
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0, c.label)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 1, c.label)
	if s.Rows >= 0 {
		ch <- prometheus.MustNewConstMetric(c.rows, prometheus.GaugeValue, s.Rows, c.label)
		if s.Rows > 0 {
			ch <- prometheus.MustNewConstMetric(c.perRow, prometheus.GaugeValue, (s.HeapBytes+s.IndexBytes)/s.Rows, c.label)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.heap, prometheus.GaugeValue, s.HeapBytes, c.label)
	ch <- prometheus.MustNewConstMetric(c.index, prometheus.GaugeValue, s.IndexBytes, c.label)
	ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, s.OldestAge.Seconds(), c.label)
	ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, s.AttemptsPending, c.label)
	ch <- prometheus.MustNewConstMetric(c.dead, prometheus.GaugeValue, s.DeadLettered, c.label)
	if s.RetentionWindow > 0 {
		ch <- prometheus.MustNewConstMetric(c.retention, prometheus.GaugeValue, s.RetentionWindow.Seconds(), c.label)
	}
	if s.Partitioned {
		ch <- prometheus.MustNewConstMetric(c.lead, prometheus.GaugeValue, s.PartitionLead.Seconds(), c.label)
	}
	if c.backlog != nil && s.OutboxBacklog >= 0 {
		ch <- prometheus.MustNewConstMetric(c.backlog, prometheus.GaugeValue, s.OutboxBacklog, c.outboxLabel)
		ch <- prometheus.MustNewConstMetric(c.backlogAge, prometheus.GaugeValue, s.OutboxOldestAge.Seconds(), c.outboxLabel)
	}
	for i, g := range c.cfg.Extra {
		var v *float64
		if err := c.q.QueryRow(ctx, g.SQL, g.Args...).Scan(&v); err != nil {
			continue
		}
		val := 0.0
		if v != nil {
			val = *v
		}
		ch <- prometheus.MustNewConstMetric(c.extra[i], prometheus.GaugeValue, val)
	}
}

// TableStats is one reading of the tables, as the gauges report it.
type TableStats struct {
	// Rows is pg_class.reltuples of the inbox table: -1 when never vacuumed or analyzed.
	Rows float64
	// HeapBytes and IndexBytes are pg_relation_size and pg_indexes_size of the inbox table.
	HeapBytes, IndexBytes float64
	// OldestAge is now - min(received_at); 0 when the table is empty.
	OldestAge time.Duration
	// AttemptsPending and DeadLettered count rows of the attempts table (capped).
	AttemptsPending, DeadLettered float64
	// OutboxBacklog counts outbox rows not relayed yet (capped); -1 without an outbox.
	OutboxBacklog float64
	// OutboxOldestAge is the age of the oldest of them.
	OutboxOldestAge time.Duration
	// RetentionWindow is the store's retention window; 0 without one.
	RetentionWindow time.Duration
	// Partitioned is true for a partitioned table; PartitionLead is then the time from now
	// to the end of its newest partition's range (negative once that has passed; 0 when the
	// table has no partition the store named).
	Partitioned   bool
	PartitionLead time.Duration
}

// Read runs the collector's queries once and returns what a scrape would report (errors are
// pgx's, wrapped; an error reading the outbox is returned too).
func (c *TableCollector) Read(ctx context.Context) (TableStats, error) {
	s := TableStats{OutboxBacklog: -1, RetentionWindow: c.window, Partitioned: c.partitioned}
	var oldest float64
	err := c.q.QueryRow(ctx, `SELECT c.reltuples::float8, pg_relation_size(c.oid)::float8, pg_indexes_size(c.oid)::float8,
		coalesce(extract(epoch FROM now() - (SELECT min(`+c.receivedAt+`) FROM `+c.table+`)), 0)::float8,
		(SELECT count(*) FROM (SELECT 1 FROM `+c.attempts+` WHERE dead_lettered_at IS NULL LIMIT $2) p)::float8,
		(SELECT count(*) FROM (SELECT 1 FROM `+c.attempts+` WHERE dead_lettered_at IS NOT NULL LIMIT $2) d)::float8
		FROM pg_class c WHERE c.oid = $1::regclass`, c.table, c.cfg.CountCap).
		Scan(&s.Rows, &s.HeapBytes, &s.IndexBytes, &oldest, &s.AttemptsPending, &s.DeadLettered)
	if err != nil {
		return s, fmt.Errorf("inboxmetrics: reading %s statistics: %w", c.table, err)
	}
	s.OldestAge = time.Duration(max(0, oldest) * float64(time.Second))
	if c.partitioned {
		if s.PartitionLead, err = c.partitionLead(ctx); err != nil {
			return s, err
		}
	}
	if c.msgs == "" {
		return s, nil
	}
	// The relay's position is (last_processed_transaction_id, offset_acked) of its consumer
	// group; the rows after it, in watermill-sql's order, are not relayed yet. created_at is a
	// TIMESTAMP in the server's time zone, hence LOCALTIMESTAMP.
	var age float64
	err = c.q.QueryRow(ctx, `WITH pos AS (
			SELECT coalesce((SELECT offset_acked FROM `+c.offsets+` WHERE consumer_group = $1), 0) AS acked,
			       coalesce((SELECT last_processed_transaction_id FROM `+c.offsets+` WHERE consumer_group = $1), '0'::xid8) AS txid),
		b AS (SELECT m.created_at FROM `+c.msgs+` m, pos
			WHERE (m.transaction_id = pos.txid AND m."offset" > pos.acked) OR m.transaction_id > pos.txid
			ORDER BY m.transaction_id, m."offset" LIMIT $2)
		SELECT count(*)::float8, coalesce(extract(epoch FROM LOCALTIMESTAMP - min(created_at)), 0)::float8 FROM b`,
		c.cfg.Outbox.ConsumerGroup, c.cfg.CountCap).Scan(&s.OutboxBacklog, &age)
	if err != nil {
		s.OutboxBacklog = -1
		return s, fmt.Errorf("inboxmetrics: reading the outbox backlog of %s: %w", c.msgs, err)
	}
	s.OutboxOldestAge = time.Duration(max(0, age) * float64(time.Second))
	return s, nil
}

// partitionLead returns the time from now to the end of the newest partition's range the store
// named (pgstore.Partition.To), 0 when there is none (claims fail now either way).
func (c *TableCollector) partitionLead(ctx context.Context) (time.Duration, error) {
	parts, err := c.store.Partitions(ctx)
	if err != nil {
		return 0, fmt.Errorf("inboxmetrics: reading the partitions of %s: %w", c.table, err)
	}
	var end time.Time
	for _, p := range parts {
		if !p.DetachPending && p.To.After(end) {
			end = p.To
		}
	}
	if end.IsZero() {
		return 0, nil
	}
	return time.Until(end), nil
}
