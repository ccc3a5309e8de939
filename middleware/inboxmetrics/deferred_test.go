package inboxmetrics_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxmetrics"
)

// TestDeferredCollectorMatchesTheTable: the store-then-process gauges equal the table's own
// counts (pending, processing, dead rows) and the counters this process's receipts; a failed
// read turns stats_up to 0 without failing the scrape.
func TestDeferredCollectorMatchesTheTable(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	ctx := context.Background()
	ib, err := deferred.New(deferred.Config{Pool: sch.Pool, Schema: sch.Name, ConsumerName: "billing",
		TooOld: inbox.TooOldGuard{ProducerTime: inbox.ProducerTimeFromMetadata("produced_at"), Window: time.Hour}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ib.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"p-1", "p-2", "p-3", "p-2"} { // p-2 twice: a duplicate receipt
		m := message.NewMessage(id, []byte(`{"amount":1}`))
		m.SetContext(ctx)
		if err := ib.Receive(m); err != nil {
			t.Fatalf("receive %s: %v", id, err)
		}
	}
	old := message.NewMessage("p-old", []byte(`{"amount":1}`)) // refused at receipt: too old
	old.Metadata.Set("produced_at", time.Now().Add(-2*time.Hour).UTC().Format(time.RFC3339))
	old.SetContext(ctx)
	if err := ib.Receive(old); !errors.Is(err, inbox.ErrTooOld) {
		t.Fatalf("receive of a too-old message: %v, want ErrTooOld", err)
	}
	// One row claimed by a worker, one dead, as the workers would leave them.
	table := ib.Table()
	if _, err := sch.Pool.Exec(ctx, "UPDATE "+table+" SET status = 'processing', claimed_at = now() WHERE message_id = 'p-1'"); err != nil {
		t.Fatal(err)
	}
	if _, err := sch.Pool.Exec(ctx, "UPDATE "+table+" SET status = 'dead', dead_at = now() WHERE message_id = 'p-3'"); err != nil {
		t.Fatal(err)
	}
	var pending, processing, dead int
	if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'processing'), count(*) FILTER (WHERE status = 'dead') FROM "+table).Scan(&pending, &processing, &dead); err != nil {
		t.Fatal(err)
	}
	if pending != 1 || processing != 1 || dead != 1 {
		t.Fatalf("table: pending %d, processing %d, dead %d; want 1 each", pending, processing, dead)
	}
	c := inboxmetrics.NewDeferredCollector(time.Second, ib)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	want := `
# HELP watermill_inbox_deferred_dead_rows Store-then-process rows in status dead (attempts used up or a permanent error).
# TYPE watermill_inbox_deferred_dead_rows gauge
watermill_inbox_deferred_dead_rows{consumer="billing"} 1
# HELP watermill_inbox_deferred_pending_rows Store-then-process rows waiting to be handled (backoff and per-aggregate order included).
# TYPE watermill_inbox_deferred_pending_rows gauge
watermill_inbox_deferred_pending_rows{consumer="billing"} 1
# HELP watermill_inbox_deferred_processing_rows Store-then-process rows claimed by workers.
# TYPE watermill_inbox_deferred_processing_rows gauge
watermill_inbox_deferred_processing_rows{consumer="billing"} 1
# HELP watermill_inbox_deferred_stats_up 1 when the last read of the store-then-process table succeeded, else 0.
# TYPE watermill_inbox_deferred_stats_up gauge
watermill_inbox_deferred_stats_up{consumer="billing"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"watermill_inbox_deferred_dead_rows", "watermill_inbox_deferred_pending_rows",
		"watermill_inbox_deferred_processing_rows", "watermill_inbox_deferred_stats_up"); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "watermill_inbox_deferred_rows_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "event" {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	if got["received"] != 3 || got["duplicate"] != 1 || got["refused"] != 1 || got["too_old"] != 1 {
		t.Errorf("rows_total %v: want received 3, duplicate 1, refused 1, too_old 1", got)
	}
	sch.Pool.Close() // the next read fails
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP watermill_inbox_deferred_stats_up 1 when the last read of the store-then-process table succeeded, else 0.
# TYPE watermill_inbox_deferred_stats_up gauge
watermill_inbox_deferred_stats_up{consumer="billing"} 0
`), "watermill_inbox_deferred_stats_up", "watermill_inbox_deferred_pending_rows"); err != nil {
		t.Fatal(err)
	}
}

// TestDeferredCollectorStuckAggregates: the stuck-aggregates gauge is the table's count of
// aggregates whose head has waited longer than StuckAfter (a gap in producer sequences: 1 done,
// 3 pending for an hour), not those whose head is fresh.
func TestDeferredCollectorStuckAggregates(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	ctx := context.Background()
	ib, err := deferred.New(deferred.Config{Pool: sch.Pool, Schema: sch.Name, ConsumerName: "billing",
		Ordering: deferred.OrderProducerSequence, SequenceField: "seq", StuckAfter: time.Minute}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ib.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	sch.Exec(t, `INSERT INTO inbox_deferred (message_id, consumer_name, message_uuid, aggregate_key, producer_seq, payload, payload_hash, status, received_at)
		VALUES ('gap-1', 'billing', 'gap-1', 'gap', 1, '\x00', '\x00', 'done', now() - interval '2 hours'),
		       ('gap-3', 'billing', 'gap-3', 'gap', 3, '\x00', '\x00', 'pending', now() - interval '1 hour'),
		       ('fresh-1', 'billing', 'fresh-1', 'fresh', 1, '\x00', '\x00', 'pending', now())`)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(inboxmetrics.NewDeferredCollector(time.Second, ib))
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP watermill_inbox_deferred_stuck_aggregates Store-then-process aggregates whose head row has waited longer than the inbox's StuckAfter (a gap in producer sequences, a failing or dead head holding its aggregate, or workers behind).
# TYPE watermill_inbox_deferred_stuck_aggregates gauge
watermill_inbox_deferred_stuck_aggregates{consumer="billing"} 1
`), "watermill_inbox_deferred_stuck_aggregates"); err != nil {
		t.Fatal(err)
	}
}
