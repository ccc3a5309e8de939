package deferred_test

import (
	"context"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
)

// TestClaimPlanByPrimaryKey: on a new table of 10,000 pending rows that has no statistics yet
// (never analyzed), the claim's plan looks its candidates up by primary key; it never reads the
// whole table. It used to join them as an IN (subquery) against a sequential scan and sort of
// the whole table on every claim (seconds per claim on a loaded machine; claims timed out).
// The claim is also run: it takes a batch of 50 rows (one head per aggregate) and sets them
// processing.
func TestClaimPlanByPrimaryKey(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  deferred.Config
	}{
		{"arrival", deferred.Config{}},
		{"producer-sequence", deferred.Config{Ordering: deferred.OrderProducerSequence, SequenceField: "seq"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ib, s := newInbox(t, tc.cfg, 0)
			s.Exec(t, `INSERT INTO inbox_deferred (message_id, consumer_name, message_uuid, aggregate_key, producer_seq, payload, payload_hash)
				SELECT 'p-' || a || '-' || e, 'billing', 'p-' || a || '-' || e, a::text, e, '\x00', sha256('\x00')
				FROM generate_series(1, 200) a, generate_series(1, 50) e`)
			ctx := context.Background()
			tx, err := s.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(ctx) }()
			rows, err := tx.Query(ctx, "EXPLAIN "+deferred.ClaimSQL(ib), "billing", 50, "w", uuid.New(), "")
			if err != nil {
				t.Fatal(err)
			}
			var plan []string
			for rows.Next() {
				var line string
				if err := rows.Scan(&line); err != nil {
					t.Fatal(err)
				}
				plan = append(plan, line)
			}
			if err := rows.Err(); err != nil {
				t.Fatal(err)
			}
			text := strings.Join(plan, "\n")
			if strings.Contains(text, "Seq Scan") {
				t.Fatalf("the claim reads the whole table:\n%s", text)
			}
			claimedRows, err := tx.Query(ctx, deferred.ClaimSQL(ib), "billing", 50, "w", uuid.New(), "")
			if err != nil {
				t.Fatal(err)
			}
			claimed := 0
			for claimedRows.Next() {
				claimed++
			}
			if err := claimedRows.Err(); err != nil {
				t.Fatal(err)
			}
			if claimed != 50 {
				t.Fatalf("the claim took %d rows, want 50", claimed)
			}
			var processing int
			if err := tx.QueryRow(ctx, "SELECT count(*) FROM inbox_deferred WHERE status = 'processing'").Scan(&processing); err != nil {
				t.Fatal(err)
			}
			if processing != 50 {
				t.Fatalf("%d rows processing after the claim, want 50", processing)
			}
		})
	}
}
