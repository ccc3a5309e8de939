package pgstore_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestDuplicateAgesHistogram: in both layouts, with and without attempt counting, every
// duplicate's claim adds its age (now minus the stored row's received time, set here) to its
// consumer's bucket, and Store.DuplicateAges reads the counts, the p50, p99 and the exact max;
// processed messages and a copy of a key in flight add nothing.
func TestDuplicateAgesHistogram(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  pgstore.Config
	}{
		{"text", pgstore.Config{}},
		{"compact", pgstore.Config{Layout: pgstore.LayoutCompact}},
		{"compact-partitioned", pgstore.Config{Layout: pgstore.LayoutCompact, Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}}},
	} {
		for _, counting := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/counting=%v", c.name, counting), func(t *testing.T) {
				testDuplicateAges(t, c.cfg, counting)
			})
		}
	}
}

func testDuplicateAges(t *testing.T, cfg pgstore.Config, counting bool) {
	ctx := context.Background()
	sch := testenv.NewSchema(t, 4)
	cfg.Schema = sch.Name
	layout := cfg.Layout
	s, err := pgstore.New(sch.Pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	if _, err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	delivery := func(n int, consumer string) contract.Delivery {
		d := plain(uuid7(fmt.Sprintf("k%d", n), now), consumer) // a UUIDv7: every layout takes it
		if counting {
			d.MaxAttempts = 3
		}
		return d
	}
	// The stored rows' ages; in the compact layout a row keeps its minute, so its age is the
	// whole minutes set plus the seconds into the current minute (up to 60 s more).
	ages := []time.Duration{5 * time.Second, 30 * time.Second, 2 * time.Minute, 2 * time.Hour, 3 * 24 * time.Hour, 20 * 24 * time.Hour}
	if layout == pgstore.LayoutCompact {
		ages = []time.Duration{2 * time.Minute, 3 * time.Minute, 10 * time.Minute, 2 * time.Hour, 3 * 24 * time.Hour, 20 * 24 * time.Hour}
	}
	for k, age := range ages {
		d := delivery(k, "billing")
		mustCommit(t, s, d)
		setReceived(t, sch, s, layout, d.Key, age)
	}
	audit := delivery(100, "audit")
	mustCommit(t, s, audit)
	setReceived(t, sch, s, layout, audit.Key, time.Hour+time.Minute)
	if got := histogramRows(t, sch, s); got != 0 {
		t.Fatalf("%d histogram rows after processing 7 messages, want 0", got)
	}

	// Duplicates: the first key three times, every other once, and audit's once.
	for range 3 {
		mustClaim(t, s, delivery(0, "billing"), contract.Duplicate)
	}
	for k := 1; k < len(ages); k++ {
		mustClaim(t, s, delivery(k, "billing"), contract.Duplicate)
	}
	mustClaim(t, s, audit, contract.Duplicate)
	// A processed message and a held key add nothing.
	mustCommit(t, s, delivery(200, "billing"))
	inFlight, _ := mustClaim(t, s, delivery(201, "billing"), contract.Run)
	cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	if tx, _, err := s.Claim(cctx, delivery(201, "billing")); err == nil {
		release(tx)
		t.Fatal("a copy of a key in flight was claimed")
	}
	cancel()
	release(inFlight)

	type bucket struct {
		lower   float64
		upper   *float64
		n       int64
		approxS float64 // the oldest age set in the bucket, in seconds
	}
	upper := func(f float64) *float64 { return &f }
	want := map[string][]bucket{
		"billing": {
			{lower: 1, upper: upper(10), n: 3, approxS: 5},
			{lower: 10, upper: upper(60), n: 1, approxS: 30},
			{lower: 60, upper: upper(300), n: 1, approxS: 120},
			{lower: 3600, upper: upper(14400), n: 1, approxS: 7200},
			{lower: 259200, upper: upper(604800), n: 1, approxS: 3 * 86400},
			{lower: 1209600, upper: upper(2592000), n: 1, approxS: 20 * 86400},
		},
		"audit": {{lower: 3600, upper: upper(14400), n: 1, approxS: 3660}},
	}
	wantP50 := 30.0 // the 4th youngest of billing's 8 is in its second bucket
	// How much older than set an age may be read: the claim comes a little later, and in the
	// compact layout up to 60 s later in the minute.
	slack := 10.0
	if layout == pgstore.LayoutCompact {
		want["billing"] = []bucket{
			{lower: 60, upper: upper(300), n: 4, approxS: 180}, // 2 min three times, 3 min
			{lower: 300, upper: upper(900), n: 1, approxS: 600},
			{lower: 3600, upper: upper(14400), n: 1, approxS: 7200},
			{lower: 259200, upper: upper(604800), n: 1, approxS: 3 * 86400},
			{lower: 1209600, upper: upper(2592000), n: 1, approxS: 20 * 86400},
		}
		wantP50, slack = 180, 61
	}
	near := func(got, want float64) bool { return got >= want-1 && got <= want+slack }
	got, err := s.DuplicateAges(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("histograms of %d consumers, want %d: %+v", len(got), len(want), got)
	}
	for name, wb := range want {
		h := got[name]
		if len(h.Buckets) != len(wb) {
			t.Fatalf("%s: buckets %+v, want %+v", name, h.Buckets, wb)
		}
		var total int64
		for k, b := range h.Buckets {
			w := wb[k]
			total += w.n
			if b.LowerSeconds != w.lower || (b.UpperSeconds == nil) != (w.upper == nil) || (b.UpperSeconds != nil && *b.UpperSeconds != *w.upper) ||
				b.Duplicates != w.n || !near(b.MaxAgeSeconds, w.approxS) {
				t.Fatalf("%s: bucket %d is [%v, %v) %d duplicates, max %.1f s; want [%v, %v) %d, max about %.0f s",
					name, k, b.LowerSeconds, deref(b.UpperSeconds), b.Duplicates, b.MaxAgeSeconds, w.lower, deref(w.upper), w.n, w.approxS)
			}
		}
		if h.Duplicates != total || !near(h.MaxSeconds, wb[len(wb)-1].approxS) || h.LastAt.IsZero() {
			t.Fatalf("%s: %d duplicates, max %.1f s, last at %v; want %d, about %.0f s, set", name, h.Duplicates, h.MaxSeconds, h.LastAt, total, wb[len(wb)-1].approxS)
		}
	}
	// billing: 8 duplicates; the 4th youngest (p50) is its bucket's oldest, the 8th (p99) is
	// in the last bucket: the max.
	b := got["billing"]
	if !near(b.P50Seconds, wantP50) || b.P99Seconds != b.MaxSeconds {
		t.Fatalf("billing: p50 %.1f s, p99 %.1f s, max %.1f s; want p50 about %.0f s and p99 the max", b.P50Seconds, b.P99Seconds, b.MaxSeconds, wantP50)
	}
	st, err := s.Stats(ctx)
	if err != nil || st.DuplicateAges["billing"].Duplicates != 8 || st.DuplicateAges["audit"].Duplicates != 1 {
		t.Fatalf("Stats: %v, duplicate ages %+v", err, st.DuplicateAges)
	}
}

// setReceived sets the stored row of k to have been received age ago (the compact layout: the
// minute age before the current one's start).
func setReceived(t *testing.T, sch *testenv.Schema, s *pgstore.Store, layout pgstore.Layout, k contract.Key, age time.Duration) {
	t.Helper()
	if layout == pgstore.LayoutCompact {
		sch.Exec(t, "UPDATE "+s.Table()+" SET received_minute = floor(extract(epoch FROM now()) / 60)::int - $1::int WHERE message_id = $2::text::uuid",
			int(age/time.Minute), k.MessageID)
		return
	}
	sch.Exec(t, "UPDATE "+s.Table()+" SET received_at = now() - $1::float8 * interval '1 second' WHERE message_id = $2 AND consumer_name = $3",
		age.Seconds(), k.MessageID, k.ConsumerName)
}

func histogramRows(t *testing.T, sch *testenv.Schema, s *pgstore.Store) int64 {
	t.Helper()
	var n int64
	if err := sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+s.DuplicateAgesTable()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func deref(f *float64) any {
	if f == nil {
		return "none"
	}
	return *f
}
