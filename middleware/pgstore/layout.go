package pgstore

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/keyrule"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Layout chooses how the inbox table stores a row (docs/retention.md, "Storage per row").
type Layout int

const (
	// LayoutText is the default layout: message_id and consumer_name as text, the full
	// 32-byte SHA-256 payload hash, message_type and correlation_id, a B-tree index on
	// received_at. Any valid key works (inbox.ValidateKey). About 200 bytes per row with
	// UUID keys (heap and indexes).
	LayoutText Layout = iota
	// LayoutCompact stores message_id as the uuid type (16 bytes), the consumer as a smallint
	// mapped through the table "<table>_consumers", the first 2 bytes of the payload's
	// SHA-256 as a smallint (enough to detect a key reused with another payload; one such
	// reuse in 65,536 goes unnoticed), the time it was received as whole minutes since the
	// Unix epoch in an integer (column received_minute), no message_type or correlation_id,
	// and a BRIN index on the time: a row is 24 bytes of data, about 93-105 bytes per row with
	// its primary-key entry (docs/retention.md). Choose it only when every key is a UUID in
	// canonical lowercase form (36 characters, as watermill.NewUUID and google/uuid write
	// them): any other key is refused with an error wrapping ErrKeyNotUUID, which the inbox
	// treats as an invalid key (dead-lettered; a flood is braked). Other spellings of a UUID
	// are refused rather than normalised, because the text layout treats them as distinct
	// keys. At most 32,767 consumer names per table (smallint).
	LayoutCompact
)

// String returns "text" or "compact".
func (l Layout) String() string {
	switch l {
	case LayoutText:
		return "text"
	case LayoutCompact:
		return "compact"
	}
	return fmt.Sprintf("Layout(%d)", int(l))
}

// PartitionInterval is the range of producer time one partition of a partitioned inbox
// table covers, in UTC.
type PartitionInterval int

const (
	// PartitionDaily: one partition per UTC day, named "<table>_pYYYYMMDD". The default.
	PartitionDaily PartitionInterval = iota
	// PartitionHourly: one partition per UTC hour, named "<table>_pYYYYMMDDHH".
	PartitionHourly
)

// Duration returns 24h or 1h.
func (i PartitionInterval) Duration() time.Duration {
	if i == PartitionHourly {
		return time.Hour
	}
	return 24 * time.Hour
}

// String returns "daily" or "hourly".
func (i PartitionInterval) String() string {
	if i == PartitionHourly {
		return "hourly"
	}
	return "daily"
}

// ProducerTimeSource says where a partitioned store reads each message's producer time, the
// partition key. It must be the same for every copy of a message, or copies land in
// different partitions and are not deduplicated.
type ProducerTimeSource int

const (
	// ProducerTimeUnset is the zero value: a partitioned store refuses it (ErrNoProducerTime).
	ProducerTimeUnset ProducerTimeSource = iota
	// ProducerTimeFromKey reads the Unix-millisecond timestamp embedded in the key, which
	// must then be a UUIDv7 (RFC 9562, section 5.7) in canonical lowercase form; any other key
	// is refused (ErrKeyNotUUIDv7). A function of the key, so stable by construction.
	ProducerTimeFromKey
	// ProducerTimeFromClaim takes the producer time the inbox reads with
	// inbox.Config.ProducerTime (a producer-set timestamp in metadata, set once when the event
	// is created). A claim without one is refused (ErrNoProducerTime).
	ProducerTimeFromClaim
)

// Partitioning turns on partitioned mode: the inbox table is range-partitioned on "period",
// the message's producer time truncated to Interval (UTC), and the primary key is (message
// ID, consumer, period). Every copy of a message carries the same producer time, so it lands
// in the same partition and the primary key still catches it; expired partitions are dropped
// whole (PartitionManager) instead of purged row by row.
type Partitioning struct {
	// Interval is the range of one partition. Default: PartitionDaily.
	Interval PartitionInterval
	// ProducerTime is required: ProducerTimeFromKey or ProducerTimeFromClaim. Without it
	// New returns an error wrapping ErrNoProducerTime and inbox.ErrInvalidConfig.
	ProducerTime ProducerTimeSource
}

// validateLayout checks cfg's layout and partitioning.
func validateLayout(cfg Config) error {
	if cfg.Layout != LayoutText && cfg.Layout != LayoutCompact {
		return fmt.Errorf("%w: pgstore: unknown layout %d", inbox.ErrInvalidConfig, cfg.Layout)
	}
	if p := cfg.Partitioning; p != nil {
		if p.Interval != PartitionDaily && p.Interval != PartitionHourly {
			return fmt.Errorf("%w: pgstore: unknown partition interval %d", inbox.ErrInvalidConfig, p.Interval)
		}
		if p.ProducerTime != ProducerTimeFromKey && p.ProducerTime != ProducerTimeFromClaim {
			return fmt.Errorf("%w: %w: set Partitioning.ProducerTime to ProducerTimeFromKey (UUIDv7 keys) or ProducerTimeFromClaim (inbox.Config.ProducerTime)", inbox.ErrInvalidConfig, ErrNoProducerTime)
		}
	}
	return nil
}

// Layout returns the configured layout.
func (s *Store) Layout() Layout { return s.cfg.Layout }

// Partitioned reports whether the store is in partitioned mode (Config.Partitioning).
func (s *Store) Partitioned() bool { return s.cfg.Partitioning != nil }

// ConsumersTable returns the quoted, schema-qualified table that maps consumer names to the
// smallint the compact layout stores, e.g. "public"."inbox_processed_messages_consumers". It
// exists only with LayoutCompact.
func (s *Store) ConsumersTable() string { return s.consumers }

// period checks p against the layout and returns the start of the partition period its claim
// belongs to (zero when not partitioned).
func (s *Store) period(p contract.Delivery) (time.Time, error) {
	id := p.Key.MessageID
	if s.cfg.Layout == LayoutCompact && !canonicalUUID(id) {
		return time.Time{}, fmt.Errorf("%w (%w)", ErrKeyNotUUID, inbox.ErrInvalidKey)
	}
	part := s.cfg.Partitioning
	if part == nil {
		return time.Time{}, nil
	}
	var t time.Time
	switch part.ProducerTime {
	case ProducerTimeFromKey:
		ts, ok := uuidV7Time(id)
		if !ok {
			return time.Time{}, fmt.Errorf("%w (%w)", ErrKeyNotUUIDv7, inbox.ErrInvalidKey)
		}
		t = ts
	default:
		if p.ProducerTime.IsZero() {
			return time.Time{}, fmt.Errorf("%w (%w)", ErrNoProducerTime, inbox.ErrInvalidKey)
		}
		t = p.ProducerTime
	}
	return PeriodOf(t, part.Interval), nil
}

// PeriodOf returns the start (UTC) of the partition period of interval that holds t.
func PeriodOf(t time.Time, interval PartitionInterval) time.Time {
	return t.UTC().Truncate(interval.Duration())
}

// canonicalUUID reports whether id is a UUID in canonical lowercase 8-4-4-4-12 form.
func canonicalUUID(id string) bool {
	if len(id) != 36 {
		return false
	}
	for i := 0; i < 36; i++ {
		c := id[i]
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
				return false
			}
		}
	}
	return true
}

// uuidV7Time returns the Unix-millisecond timestamp (UTC) of a canonical lowercase UUIDv7:
// keyrule.UUIDv7Time, restricted to lowercase so that exactly the keys uuidV7Pattern matches in
// LayoutMigrationSQL's conversion are accepted.
func uuidV7Time(id string) (time.Time, bool) {
	if !canonicalUUID(id) {
		return time.Time{}, false
	}
	t, ok := keyrule.UUIDv7Time(id)
	return t.UTC(), ok
}

// compactHashBytes is how many leading bytes of the payload's SHA-256 the compact layout
// keeps (a smallint, big-endian): a duplicate is compared with that prefix of its hash.
const compactHashBytes = 2

// hashArg is the payload hash as the claim stores it: the whole hash (text layout), or its
// first 2 bytes as a big-endian signed smallint (compact layout; NULL when shorter).
func (s *Store) hashArg(h []byte) any {
	if s.cfg.Layout != LayoutCompact {
		return h
	}
	return compactHash(h)
}

// compactHash is the compact layout's payload_hash of the SHA-256 h: its first
// compactHashBytes bytes as a big-endian int16, or nil when h is shorter.
func compactHash(h []byte) *int16 {
	if len(h) < compactHashBytes {
		return nil
	}
	v := int16(binary.BigEndian.Uint16(h))
	return &v
}

// scanHash scans a row of queries/stored_hash.sql: the stored payload hash into dst, as bytes
// (compactHashBytes bytes in the compact layout), and when the claim was stored into at.
func (s *Store) scanHash(row pgx.Row, dst *[]byte, at *time.Time) error {
	if s.cfg.Layout != LayoutCompact {
		return row.Scan(dst, at)
	}
	var v *int16
	if err := row.Scan(&v, at); err != nil || v == nil {
		return err
	}
	*dst = binary.BigEndian.AppendUint16(nil, uint16(*v))
	return nil
}

// receivedColumn is the inbox table's time column: received_at (timestamptz) in the text
// layout, received_minute (integer, whole minutes since 1970-01-01 UTC) in the compact one.
// Purge and stats order and filter by it, so its index serves them.
func (s *Store) receivedColumn() string {
	if s.cfg.Layout == LayoutCompact {
		return "received_minute"
	}
	return "received_at"
}

// receivedBefore is the predicate "received before the timestamptz in param" on the time
// column itself, so its index serves it. In the compact layout a row's minute must end at or
// before param's minute begins: a row is never purged before its time, at most a minute after.
func (s *Store) receivedBefore(param string) string {
	if s.cfg.Layout == LayoutCompact {
		return "received_minute < floor(extract(epoch FROM " + param + "::timestamptz) / 60)::integer"
	}
	return "received_at < " + param
}

// ReceivedAtSQL returns the SQL expression (a timestamptz) for the time a row of the inbox
// table was received, over its unqualified column: "received_at" in the text layout; in the
// compact layout the start of the minute received_minute holds,
// "to_timestamp(received_minute * 60::float8)". For readers of the table outside this
// package (inboxmetrics).
func (s *Store) ReceivedAtSQL() string {
	if s.cfg.Layout == LayoutCompact {
		return "to_timestamp(received_minute * 60::float8)"
	}
	return "received_at"
}

// wrapNoPartition wraps a claim error that is PostgreSQL's "no partition of relation ...
// found for row" (SQLSTATE 23514 on a table that has no check constraint) with
// ErrNoPartition.
func (s *Store) wrapNoPartition(err error, period time.Time) error {
	var pgErr *pgconn.PgError
	if s.cfg.Partitioning != nil && errors.As(err, &pgErr) && pgErr.Code == "23514" {
		return fmt.Errorf("%w: period %s of %s (create it as the table's owner: watermill-inbox partitions ensure, or a PartitionManager on the owner's pool): %w",
			ErrNoPartition, period.Format(time.RFC3339), s.table, err)
	}
	return err
}

// consumerMatch is the inbox table's predicate "the row's consumer is the name in param".
func (s *Store) consumerMatch(param string) string {
	if s.cfg.Layout == LayoutCompact {
		return "consumer_id = (SELECT consumer_id FROM " + s.consumers + " WHERE consumer_name = " + param + ")"
	}
	return "consumer_name = " + param
}
