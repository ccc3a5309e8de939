package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Defaults of PartitionManagerConfig.
const (
	// DefaultPartitionLead is how far ahead of now partitions are created: 48 hours. It must
	// cover the producers' clock skew and how long the PartitionManager may be down.
	DefaultPartitionLead = 48 * time.Hour
	// DefaultPartitionCheckInterval is how often PartitionManager.Run creates and drops
	// partitions: 10 minutes.
	DefaultPartitionCheckInterval = 10 * time.Minute
)

// Partition is one partition of a partitioned inbox table.
type Partition struct {
	// Name is the partition's table name (unquoted), "<table>_pYYYYMMDD" or "<table>_pYYYYMMDDHH".
	Name string
	// From and To are its producer-time range [From, To) in UTC; zero for a partition whose
	// name the store did not give (it is listed, never dropped).
	From, To time.Time
	// Rows is PostgreSQL's estimate (pg_class.reltuples, as of the last VACUUM or ANALYZE;
	// -1 when never analysed).
	Rows int64
	// Bytes is its heap plus index size in bytes (pg_total_relation_size).
	Bytes int64
	// DetachPending is true for a partition whose DETACH ... CONCURRENTLY was interrupted;
	// DropPartitions finishes it (DETACH ... FINALIZE).
	DetachPending bool
}

// partitionName returns the partition of the period starting at from.
func (s *Store) partitionName(from time.Time) string {
	if s.cfg.Partitioning.Interval == PartitionHourly {
		return s.cfg.Table + "_p" + from.UTC().Format("2006010215")
	}
	return s.cfg.Table + "_p" + from.UTC().Format("20060102")
}

// parsePartitionName returns the range of a partition named by partitionName.
func (s *Store) parsePartitionName(name string) (from, to time.Time, ok bool) {
	suffix, found := strings.CutPrefix(name, s.cfg.Table+"_p")
	if !found {
		return from, to, false
	}
	layout := "20060102"
	if s.cfg.Partitioning.Interval == PartitionHourly {
		layout = "2006010215"
	}
	if len(suffix) != len(layout) {
		return from, to, false
	}
	from, err := time.ParseInLocation(layout, suffix, time.UTC)
	if err != nil {
		return from, to, false
	}
	return from, from.Add(s.cfg.Partitioning.Interval.Duration()), true
}

// Partitions lists the inbox table's partitions, oldest first (by name). It returns
// ErrNotPartitioned for a store without partitioning.
func (s *Store) Partitions(ctx context.Context) ([]Partition, error) {
	if s.cfg.Partitioning == nil {
		return nil, ErrNotPartitioned
	}
	rows, err := s.pool.Query(ctx, `
		SELECT c.relname, c.reltuples::bigint, pg_total_relation_size(c.oid), i.inhdetachpending
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = $1::regclass
		ORDER BY c.relname`, s.table)
	if err != nil {
		return nil, fmt.Errorf("pgstore: list partitions: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Partition, error) {
		var p Partition
		err := row.Scan(&p.Name, &p.Rows, &p.Bytes, &p.DetachPending)
		p.From, p.To, _ = s.parsePartitionName(p.Name)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("pgstore: list partitions: %w", err)
	}
	return out, nil
}

// partitionLockKey is the advisory lock that serialises partition maintenance of one table
// across instances.
func (s *Store) partitionLockKey() string { return "watermill-inbox:partitions:" + s.table }

// withPartitionLock runs f on a connection holding the table's session-level maintenance lock
// (pg_advisory_lock), so two instances never create or drop partitions at once.
func (s *Store) withPartitionLock(ctx context.Context, f func(conn *pgxpool.Conn) error) error {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("pgstore: partitions: acquire a connection: %w", err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock(hashtextextended($1, 0))", s.partitionLockKey()); err != nil {
		return fmt.Errorf("pgstore: partitions: lock: %w", err)
	}
	defer func() {
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, err := conn.Exec(uctx, "SELECT pg_advisory_unlock(hashtextextended($1, 0))", s.partitionLockKey()); err != nil {
			_ = conn.Conn().Close(uctx) // the lock ends with the session
		}
	}()
	return f(conn)
}

// EnsurePartitions creates the missing partitions whose periods overlap [from, to] (UTC
// periods of the configured interval) and returns the names it created. It is idempotent and
// safe to run from several instances at once (an advisory lock serialises them). Each
// partition is created as a table and attached (ALTER TABLE ... ATTACH PARTITION), in one
// transaction: that takes a SHARE UPDATE EXCLUSIVE lock on the parent, which running claims
// do not conflict with (CREATE TABLE ... PARTITION OF would take ACCESS EXCLUSIVE).
func (s *Store) EnsurePartitions(ctx context.Context, from, to time.Time) (created []string, err error) {
	if s.cfg.Partitioning == nil {
		return nil, ErrNotPartitioned
	}
	if to.Before(from) {
		return nil, fmt.Errorf("%w: pgstore: EnsurePartitions: to %s is before from %s", inbox.ErrInvalidConfig, to, from)
	}
	step := s.cfg.Partitioning.Interval.Duration()
	if n := to.Sub(from) / step; n > 100_000 {
		return nil, fmt.Errorf("%w: pgstore: EnsurePartitions: %d partitions requested", inbox.ErrInvalidConfig, n)
	}
	err = s.withPartitionLock(ctx, func(conn *pgxpool.Conn) error {
		for p := PeriodOf(from, s.cfg.Partitioning.Interval); !p.After(to); p = p.Add(step) {
			name := s.partitionName(p)
			var exists bool
			if err := conn.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL",
				pgx.Identifier{s.cfg.Schema, name}.Sanitize()).Scan(&exists); err != nil {
				return fmt.Errorf("pgstore: partitions: look up %s: %w", name, err)
			}
			if exists {
				continue
			}
			// CREATE TABLE ... PARTITION OF would take an ACCESS EXCLUSIVE lock on the parent,
			// queueing every claim behind any long inbox transaction. A table created apart and
			// attached takes only SHARE UPDATE EXCLUSIVE on the parent, which claims (ROW
			// EXCLUSIVE) do not conflict with. One transaction: no half-made partition stays.
			qname := pgx.Identifier{s.cfg.Schema, name}.Sanitize()
			err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "CREATE TABLE "+qname+" (LIKE "+s.table+" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, fmt.Sprintf("ALTER TABLE %s ATTACH PARTITION %s FOR VALUES FROM (%s) TO (%s)",
					s.table, qname, quoteLiteral(p.Format(time.RFC3339)), quoteLiteral(p.Add(step).Format(time.RFC3339))))
				return err
			})
			if err != nil {
				return fmt.Errorf("pgstore: partitions: create %s: %w", name, err)
			}
			created = append(created, name)
		}
		return nil
	})
	return created, ownerError(err)
}

// DropPartitions detaches and drops every partition whose whole range ends at or before
// olderThan (To <= olderThan), oldest first, and returns the names it dropped. Each is
// detached with ALTER TABLE ... DETACH PARTITION ... CONCURRENTLY (PostgreSQL 14 and later;
// it takes only a SHARE UPDATE EXCLUSIVE lock on the parent, so claims go on), or without
// CONCURRENTLY on an older server; a partition left "detach pending" by an interrupted
// detach is finished first (DETACH ... FINALIZE). Then DROP TABLE. Partitions whose names the
// store did not give are never touched. Dropping a partition forgets its messages: a copy of
// one of them that arrives later is processed again, so olderThan must be before now minus
// the retention window (PartitionManager computes it).
func (s *Store) DropPartitions(ctx context.Context, olderThan time.Time) (dropped []string, err error) {
	if s.cfg.Partitioning == nil {
		return nil, ErrNotPartitioned
	}
	err = s.withPartitionLock(ctx, func(conn *pgxpool.Conn) error {
		parts, err := s.Partitions(ctx)
		if err != nil {
			return err
		}
		var version int
		if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
			return fmt.Errorf("pgstore: partitions: server version: %w", err)
		}
		for _, p := range parts {
			if p.To.IsZero() || p.To.After(olderThan) {
				continue
			}
			name := pgx.Identifier{s.cfg.Schema, p.Name}.Sanitize()
			detach := "ALTER TABLE " + s.table + " DETACH PARTITION " + name
			switch {
			case p.DetachPending:
				detach += " FINALIZE"
			case version >= 140000:
				detach += " CONCURRENTLY" // outside a transaction block: Exec sends it alone
			}
			if _, err := conn.Exec(ctx, detach); err != nil {
				return fmt.Errorf("pgstore: partitions: detach %s: %w", p.Name, err)
			}
			if _, err := conn.Exec(ctx, "DROP TABLE "+name); err != nil {
				return fmt.Errorf("pgstore: partitions: drop %s (detached): %w", p.Name, err)
			}
			dropped = append(dropped, p.Name)
		}
		return nil
	})
	return dropped, ownerError(err)
}

// PartitionManagerConfig configures a PartitionManager.
type PartitionManagerConfig struct {
	// Retention is the retention window (required, positive): a partition is dropped once its
	// whole range ends more than Retention before now. It must exceed the longest
	// redelivery, dead-letter replay or offset reset you support, plus a margin (see
	// docs/retention.md): a copy of a message whose partition was dropped is processed again.
	Retention time.Duration
	// Lead is how far ahead of now partitions are created. Default: DefaultPartitionLead.
	// Partitions are also kept from now minus Retention, so late copies find theirs.
	Lead time.Duration
	// CheckInterval is the pause between rounds. Default: DefaultPartitionCheckInterval.
	CheckInterval time.Duration
	// Now is the clock. Default: time.Now.
	Now func() time.Time
}

// PartitionManager keeps a partitioned inbox table's partitions: it creates them ahead (from
// now minus Retention to now plus Lead) and drops expired ones, once per CheckInterval. Run
// it beside the router like Watermill's components (Run(ctx) until Close or ctx ends). One
// instance at a time works on a table (an advisory lock); running it on every instance is
// safe.
type PartitionManager struct {
	s      *Store
	cfg    PartitionManagerConfig
	logger watermill.LoggerAdapter

	closeOnce sync.Once
	closing   chan struct{}
	running   chan struct{}
	done      chan struct{}
}

// NewPartitionManager returns a PartitionManager for s, or an error wrapping
// inbox.ErrInvalidConfig: s not partitioned (ErrNotPartitioned), Retention not positive,
// Lead or CheckInterval negative. A nil logger discards logs.
func NewPartitionManager(s *Store, cfg PartitionManagerConfig, logger watermill.LoggerAdapter) (*PartitionManager, error) {
	if s == nil || s.cfg.Partitioning == nil {
		return nil, ErrNotPartitioned
	}
	if cfg.Retention <= 0 {
		return nil, fmt.Errorf("%w: pgstore: PartitionManagerConfig.Retention must be positive (the retention window)", inbox.ErrInvalidConfig)
	}
	if cfg.Lead < 0 || cfg.CheckInterval < 0 {
		return nil, fmt.Errorf("%w: pgstore: PartitionManagerConfig: negative duration", inbox.ErrInvalidConfig)
	}
	if cfg.Lead == 0 {
		cfg.Lead = DefaultPartitionLead
	}
	if cfg.CheckInterval == 0 {
		cfg.CheckInterval = DefaultPartitionCheckInterval
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &PartitionManager{s: s, cfg: cfg, logger: logger.With(watermill.LogFields{"table": s.table}),
		closing: make(chan struct{}), running: make(chan struct{}, 1), done: make(chan struct{})}, nil
}

// RoundResult is what one PartitionManager round did.
type RoundResult struct {
	// Created and Dropped name the partitions created and dropped.
	Created, Dropped []string
}

// RunOnce runs one round: EnsurePartitions from now minus Retention to now plus Lead, then
// DropPartitions older than now minus Retention (rounded down to a partition boundary).
func (m *PartitionManager) RunOnce(ctx context.Context) (RoundResult, error) {
	var r RoundResult
	now := m.cfg.Now()
	var err error
	if r.Created, err = m.s.EnsurePartitions(ctx, now.Add(-m.cfg.Retention), now.Add(m.cfg.Lead)); err != nil {
		return r, err
	}
	r.Dropped, err = m.s.DropPartitions(ctx, now.Add(-m.cfg.Retention))
	return r, err
}

// Run runs a round at once and then every CheckInterval until ctx ends or Close is called;
// it returns nil then. A failed round is logged at ERROR and retried at the next interval.
// Run may be called once.
func (m *PartitionManager) Run(ctx context.Context) error {
	select {
	case m.running <- struct{}{}:
	default:
		select {
		case <-m.closing:
			return nil // closed before it ran
		default:
		}
		return errors.New("pgstore: PartitionManager.Run called twice")
	}
	defer close(m.done)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-m.closing:
			cancel()
		case <-ctx.Done():
		}
	}()
	t := time.NewTicker(m.cfg.CheckInterval)
	defer t.Stop()
	for {
		r, err := m.RunOnce(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			m.logger.Error("Partition maintenance failed; retrying at the next interval", err, nil)
		case len(r.Created)+len(r.Dropped) > 0:
			m.logger.Info("Partitions maintained", watermill.LogFields{"created": r.Created, "dropped": r.Dropped})
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Close stops Run and waits for it to return (at most until ctx-free statements end; a
// running DETACH CONCURRENTLY is cancelled with its context). Safe to call more than once
// and without Run.
func (m *PartitionManager) Close() error {
	m.closeOnce.Do(func() { close(m.closing) })
	select {
	case m.running <- struct{}{}:
		return nil // Run never started; it cannot start now
	default:
	}
	<-m.done
	return nil
}

// ownerError wraps err with ErrPartitionOwner when it is SQLSTATE 42501.
func ownerError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		return fmt.Errorf("%w (run `watermill-inbox partitions ensure` and `partitions drop` as the owner): %w", ErrPartitionOwner, err)
	}
	return err
}
