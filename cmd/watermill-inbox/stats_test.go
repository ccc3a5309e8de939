package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
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
