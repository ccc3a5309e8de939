package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestDiscardDeadLettersInBatches: DiscardDeadLetters deletes every record its filter selects
// over several batches (2,500 records, DiscardBatchSize 1,000), a positive Limit stops it at
// that many (the oldest first), and it never deletes a record outside the filter or one that
// is not dead-lettered.
func TestDiscardDeadLettersInBatches(t *testing.T) {
	ctx := context.Background()
	sch := testenv.NewSchema(t, 2)
	s := retentionStore(t, sch, hourly)
	sch.Exec(t, "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, dead_lettered_at, dead_letter_reason)"+
		" SELECT 'flood-' || g, 'billing', now() - g * interval '1 second', 'invalid key' FROM generate_series(1, 2500) g")
	sch.Exec(t, "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, dead_lettered_at, dead_letter_reason) VALUES"+
		" ('other-reason', 'billing', now(), 'permanent error: bad'), ('other-consumer', 'shipping', now(), 'invalid key')")
	sch.Exec(t, "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name) VALUES ('live', 'billing')")
	count := func(where string) int64 {
		var n int64
		if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM inbox_processed_messages_attempts WHERE "+where).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	f := pgstore.DeadLetterFilter{ConsumerName: "billing", Reason: "invalid key"}

	groups, err := s.DeadLetterReasons(ctx, f)
	if err != nil || len(groups) != 1 || groups[0].Count != 2500 || !groups[0].FirstSeen.Before(groups[0].LastSeen) {
		t.Fatalf("DeadLetterReasons = %+v, %v; want one group of 2500", groups, err)
	}
	limited := f
	limited.Limit = 1200
	n, err := s.DiscardDeadLetters(ctx, limited)
	if err != nil || n != 1200 {
		t.Fatalf("DiscardDeadLetters(Limit 1200) = %d, %v", n, err)
	}
	// The oldest go first: the 1,300 newest (flood-1 .. flood-1300) are left.
	if left := count("message_id LIKE 'flood-%'"); left != 1300 || count("message_id IN ('flood-1', 'flood-1300')") != 2 {
		t.Fatalf("after the limited discard: %d flood records left, want the 1300 newest", left)
	}
	if n, err = s.DiscardDeadLetters(ctx, f); err != nil || n != 1300 {
		t.Fatalf("DiscardDeadLetters = %d, %v; want 1300", n, err)
	}
	if count("true") != 3 || count("message_id IN ('other-reason', 'other-consumer', 'live')") != 3 {
		t.Fatal("a record outside the filter was deleted")
	}
	recs, err := s.DeadLetters(ctx, pgstore.DeadLetterFilter{Until: time.Now().Add(time.Hour)})
	if err != nil || len(recs) != 2 {
		t.Fatalf("DeadLetters after the discard = %+v, %v; want the 2 outside the filter", recs, err)
	}
}
