package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestStatsOutputIsBounded: with 500 consumer names, stats lists the 50 (default) or --limit
// consumers with the most rows and one line for the rest, --limit 0 lists all, and --json is
// bounded the same way with the rest counted in other_consumers; the row total stays exact.
func TestStatsOutputIsBounded(t *testing.T) {
	sch, conn := migrated(t)
	// consumer c-1 has 1 row, c-2 2 rows, ..., c-500 500 rows.
	sch.Exec(t, "INSERT INTO inbox_processed_messages (message_id, consumer_name) SELECT 'k' || n || '-' || i, 'c-' || n FROM generate_series(1, 500) n, generate_series(1, n) i")
	const total = 500 * 501 / 2
	lines := func(out string) int { return strings.Count(out, "\nconsumer ") }
	out, err := run(t, append([]string{"stats"}, conn...)...)
	if err != nil || lines("\n"+out) != 50 || !strings.Contains(out, `"c-500": 500 rows`) || strings.Contains(out, `"c-450":`) ||
		!strings.Contains(out, fmt.Sprintf("other consumers  450: %d rows", total-(451+500)*50/2)) {
		t.Fatalf("stats: %v, %d consumer lines, want 50 and one for the other 450:\n%s", err, lines("\n"+out), out)
	}
	if out, err = run(t, append([]string{"stats", "--limit", "5"}, conn...)...); err != nil || lines("\n"+out) != 5 || !strings.Contains(out, "other consumers  495:") {
		t.Fatalf("stats --limit 5: %v\n%s", err, out)
	}
	if out, err = run(t, append([]string{"stats", "--limit", "0"}, conn...)...); err != nil || lines("\n"+out) != 500 || strings.Contains(out, "other consumers") {
		t.Fatalf("stats --limit 0: %v, %d lines", err, lines("\n"+out))
	}
	out, err = run(t, append([]string{"stats", "--json", "--limit", "3"}, conn...)...)
	var st struct {
		Rows              int64            `json:"rows"`
		PerConsumer       map[string]int64 `json:"per_consumer"`
		OtherConsumers    int              `json:"other_consumers"`
		OtherConsumerRows int64            `json:"other_consumer_rows"`
	}
	if err != nil || json.Unmarshal([]byte(out), &st) != nil || st.Rows != total || len(st.PerConsumer) != 3 || st.PerConsumer["c-498"] != 498 ||
		st.OtherConsumers != 497 || st.OtherConsumerRows != total-(498+499+500) {
		t.Fatalf("stats --json --limit 3: %v, %+v\n%s", err, st, out)
	}
	if _, err := run(t, append([]string{"stats", "--limit", "-1"}, conn...)...); exitCode(err) != exitUsage {
		t.Fatalf("stats --limit -1: %v, want a usage error", err)
	}
}

// TestStatsDuplicateAges: duplicates of rows stored 30 s, 2 h, 2 h 30 min and 5 days ago (and
// one of another consumer's, 10 min) fill the duplicate-age table's buckets, and stats prints
// each consumer's count, p50, p99, max and, with --window, the margin the window leaves (or
// that it is shorter than the oldest duplicate), in text and JSON; --window 0 is a usage error.
func TestStatsDuplicateAges(t *testing.T) {
	sch, conn := migrated(t)
	sch.Exec(t, `INSERT INTO inbox_processed_messages (message_id, consumer_name, payload_hash, received_at) VALUES
		('d1', 'billing', sha256('p'), now() - interval '30 seconds'),
		('d2', 'billing', sha256('p'), now() - interval '2 hours'),
		('d3', 'billing', sha256('p'), now() - interval '2 hours 30 minutes'),
		('d4', 'billing', sha256('p'), now() - interval '5 days'),
		('a1', 'audit', sha256('p'), now() - interval '10 minutes')`)
	store, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	deliver := func(consumer string, ids ...string) {
		ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: consumer}, nil)
		if err != nil {
			t.Fatal(err)
		}
		h := ib.Middleware(func(*message.Message) ([]*message.Message, error) {
			return nil, errors.New("the handler ran for a duplicate")
		})
		for _, id := range ids {
			if _, err := h(message.NewMessage(id, []byte("p"))); err != nil {
				t.Fatalf("%s %s: %v", consumer, id, err)
			}
		}
		if st := ib.Stats(); st.Duplicates != uint64(len(ids)) {
			t.Fatalf("%s: %d duplicates, want %d", consumer, st.Duplicates, len(ids))
		}
	}
	deliver("billing", "d1", "d2", "d3", "d4")
	deliver("audit", "a1")

	rows, err := sch.Pool.Query(context.Background(), "SELECT consumer_name || ' ' || lower_seconds || ' ' || duplicates FROM inbox_processed_messages_duplicate_ages ORDER BY 1")
	if err != nil {
		t.Fatal(err)
	}
	buckets, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if want := []string{"audit 300 1", "billing 10 1", "billing 259200 1", "billing 3600 2"}; err != nil || !slices.Equal(buckets, want) {
		t.Fatalf("buckets %q (%v), want %q", buckets, err, want)
	}

	out, err := run(t, append([]string{"stats", "--window", "7d"}, conn...)...)
	wantLines := []string{
		`duplicate ages   "billing": 4 duplicates, p50 2h30m0s, p99 5d, max 5d, margin 2d in the 7d window`,
		`duplicate ages   "audit": 1 duplicates, p50 10m0s, p99 10m0s, max 10m0s, margin 6d23h50m0s in the 7d window`,
	}
	for _, l := range wantLines {
		if err != nil || !strings.Contains(out, l+"\n") {
			t.Fatalf("stats --window 7d: %v, want the line %q:\n%s", err, l, out)
		}
	}
	if out, err = run(t, append([]string{"stats", "--window", "3d"}, conn...)...); err != nil ||
		!strings.Contains(out, `"billing": 4 duplicates, p50 2h30m0s, p99 5d, max 5d, margin -2d: the 3d window is shorter than the oldest duplicate`) {
		t.Fatalf("stats --window 3d: %v\n%s", err, out)
	}
	if out, err = run(t, append([]string{"stats"}, conn...)...); err != nil || !strings.Contains(out, `"billing": 4 duplicates, p50 2h30m0s, p99 5d, max 5d (--window for the margin)`) {
		t.Fatalf("stats: %v\n%s", err, out)
	}
	if out, err = run(t, append([]string{"stats", "--limit", "1"}, conn...)...); err != nil || strings.Contains(out, `"audit": 1 duplicates`) ||
		!strings.Contains(out, "duplicate ages   1 other consumers (--limit 1 shows more)") {
		t.Fatalf("stats --limit 1: %v\n%s", err, out)
	}

	out, err = run(t, append([]string{"stats", "--json", "--window", "7d"}, conn...)...)
	var st struct {
		DuplicateAges map[string]pgstore.DuplicateAges `json:"duplicate_ages"`
		Window        float64                          `json:"retention_window_seconds"`
		Margins       map[string]float64               `json:"duplicate_age_margin_seconds"`
	}
	near := func(got, want float64) bool { return got >= want-1 && got <= want+5 }
	if err != nil || json.Unmarshal([]byte(out), &st) != nil {
		t.Fatalf("stats --json: %v\n%s", err, out)
	}
	b := st.DuplicateAges["billing"]
	if b.Duplicates != 4 || len(b.Buckets) != 3 || !near(b.P50Seconds, 9000) || !near(b.P99Seconds, 5*86400) || !near(b.MaxSeconds, 5*86400) ||
		st.Window != 7*86400 || !near(2*86400, st.Margins["billing"]) || st.DuplicateAges["audit"].Duplicates != 1 {
		t.Fatalf("stats --json --window 7d: %+v\n%s", st, out)
	}
	if _, err := run(t, append([]string{"stats", "--window", "0s"}, conn...)...); exitCode(err) != exitUsage {
		t.Fatalf("stats --window 0s: %v, want a usage error", err)
	}
}
