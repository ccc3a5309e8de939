package pgstore

import (
	"context"
	"fmt"
	"math"
	"time"
)

// DuplicateAges is one consumer's duplicate-age histogram (migration 0005): how old each
// duplicate was when it arrived, the claim's time minus the stored row's received time on the
// database's clock (to the minute in the compact layout), counted since the table was created.
// A duplicate's claim adds it after its rollback, in the same round trip (the immediate inbox's
// Claim); a processed message never touches it. The retention window must stay above the
// oldest duplicate, with a margin (docs/retention.md).
//
// The buckets' lower bounds are 0, 1 s, 10 s, 1 min, 5 min, 15 min, 1 h, 4 h, 12 h, 1, 2, 3,
// 7, 14, 30 and 60 days; each bucket ends at the next bound and the last has none. Every
// bucket also keeps its oldest duplicate, so a percentile is reported as the oldest duplicate of
// the bucket holding it: never below the true percentile, and above it by less than the
// bucket's width.
type DuplicateAges struct {
	// Duplicates counts the duplicates measured.
	Duplicates int64 `json:"duplicates"`
	// P50Seconds and P99Seconds are the 50th and 99th percentiles of the ages (nearest rank),
	// in seconds, as the oldest duplicate of the bucket holding each.
	P50Seconds float64 `json:"p50_seconds"`
	P99Seconds float64 `json:"p99_seconds"`
	// MaxSeconds is the oldest duplicate's age, in seconds, exact.
	MaxSeconds float64 `json:"max_seconds"`
	// LastAt is when the last duplicate was measured.
	LastAt time.Time `json:"last_at"`
	// Buckets are the non-empty buckets, youngest first.
	Buckets []DuplicateAgeBucket `json:"buckets"`
}

// DuplicateAgeBucket is one bucket of a DuplicateAges histogram.
type DuplicateAgeBucket struct {
	// LowerSeconds and UpperSeconds bound the bucket's ages, in seconds: at least
	// LowerSeconds, below UpperSeconds; UpperSeconds is nil for the last bucket (no bound).
	LowerSeconds float64  `json:"lower_seconds"`
	UpperSeconds *float64 `json:"upper_seconds"`
	// Duplicates counts the duplicates whose age fell in the bucket.
	Duplicates int64 `json:"duplicates"`
	// MaxAgeSeconds is the oldest of them, in seconds, exact.
	MaxAgeSeconds float64 `json:"max_age_seconds"`
	// LastAt is when the bucket last counted a duplicate.
	LastAt time.Time `json:"last_at"`
}

// DuplicateAges reads every consumer's duplicate-age histogram (queries/duplicate_ages.sql, a
// read of the small histogram table, never of the inbox table), keyed by consumer name, with
// the percentiles and the maximum computed. A consumer that has seen no duplicate has no
// entry. Errors are the database's, wrapped (a missing table: migration 0005 is not applied).
func (s *Store) DuplicateAges(ctx context.Context) (map[string]DuplicateAges, error) {
	rows, err := s.pool.Query(ctx, s.q.duplicateAges.sql)
	if err != nil {
		return nil, fmt.Errorf("pgstore: duplicate ages: %w", err)
	}
	defer rows.Close()
	out := map[string]DuplicateAges{}
	for rows.Next() {
		var name string
		var b DuplicateAgeBucket
		if err := rows.Scan(&name, &b.LowerSeconds, &b.UpperSeconds, &b.Duplicates, &b.MaxAgeSeconds, &b.LastAt); err != nil {
			return nil, fmt.Errorf("pgstore: duplicate ages: %w", err)
		}
		h := out[name]
		h.Buckets = append(h.Buckets, b)
		out[name] = h
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("pgstore: duplicate ages: %w", err)
	}
	for name, h := range out {
		out[name] = h.summarized()
	}
	return out, nil
}

// summarized fills the totals, percentiles and maximum from h.Buckets (youngest first).
func (h DuplicateAges) summarized() DuplicateAges {
	h.Duplicates, h.MaxSeconds, h.LastAt = 0, 0, time.Time{}
	for _, b := range h.Buckets {
		h.Duplicates += b.Duplicates
		h.MaxSeconds = max(h.MaxSeconds, b.MaxAgeSeconds)
		if b.LastAt.After(h.LastAt) {
			h.LastAt = b.LastAt
		}
	}
	h.P50Seconds, h.P99Seconds = h.percentile(50), h.percentile(99)
	return h
}

// percentile is the oldest age of the bucket holding the p-th percentile (nearest rank: the
// ceil(p/100 * Duplicates)-th youngest duplicate), in seconds; 0 without duplicates.
func (h DuplicateAges) percentile(p float64) float64 {
	rank := int64(math.Ceil(p / 100 * float64(h.Duplicates)))
	var seen int64
	for _, b := range h.Buckets {
		seen += b.Duplicates
		if seen >= max(rank, 1) {
			return b.MaxAgeSeconds
		}
	}
	return 0
}
