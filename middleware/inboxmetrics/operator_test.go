package inboxmetrics_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxmetrics"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestRetentionAndPartitionLeadGauges: the gauges the shipped alerts compare with
// (deploy/prometheus/inbox.rules.yml): retention_window_seconds is the store's window, and
// partition_lead_seconds the time to the end of the newest partition: 10 to 11 hours after
// creating hourly partitions up to 10 hours ahead, and negative once every partition has
// passed. A table without retention or partitions reports neither.
func TestRetentionAndPartitionLeadGauges(t *testing.T) {
	ctx := context.Background()
	sch := testenv.NewSchema(t, 2)
	store, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Table: "leads",
		Partitioning: &pgstore.Partitioning{Interval: pgstore.PartitionHourly, ProducerTime: pgstore.ProducerTimeFromKey},
		Retention:    inbox.Retention{Window: 10 * 24 * time.Hour, MaxRedelivery: 7 * 24 * time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	parts, err := store.Partitions(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range parts { // whatever Migrate created: start from none
		sch.Exec(t, "DROP TABLE "+sch.Name+"."+p.Name)
	}
	now := time.Now()
	if _, err := store.EnsurePartitions(ctx, now.Add(-time.Hour), now.Add(10*time.Hour)); err != nil {
		t.Fatal(err)
	}
	c, err := inboxmetrics.NewTableCollector(store, inboxmetrics.TableConfig{})
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.Read(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !st.Partitioned || st.PartitionLead <= 10*time.Hour-time.Minute || st.PartitionLead > 11*time.Hour {
		t.Fatalf("partition lead %s (partitioned %t), want 10 to 11 hours", st.PartitionLead, st.Partitioned)
	}
	if st.RetentionWindow != 10*24*time.Hour {
		t.Fatalf("retention window %s, want 240h", st.RetentionWindow)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	if n, err := testutil.GatherAndCount(reg, "watermill_inbox_retention_window_seconds", "watermill_inbox_partition_lead_seconds"); err != nil || n != 2 {
		t.Fatalf("gathered %d retention and lead series, %v; want 2", n, err)
	}

	// Every partition in the past: the lead is negative.
	for _, p := range mustPartitions(t, store) {
		if p.From.After(now.Add(-time.Hour)) {
			sch.Exec(t, "DROP TABLE "+sch.Name+"."+p.Name)
		}
	}
	if st, err = c.Read(ctx); err != nil || st.PartitionLead >= 0 || st.PartitionLead < -time.Hour {
		t.Fatalf("partition lead with only the past hour's partition: %s, %v; want between -1h and 0", st.PartitionLead, err)
	}

	plain, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Table: "plain"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := plain.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	pc, err := inboxmetrics.NewTableCollector(plain, inboxmetrics.TableConfig{})
	if err != nil {
		t.Fatal(err)
	}
	reg = prometheus.NewPedanticRegistry()
	reg.MustRegister(pc)
	if n, err := testutil.GatherAndCount(reg, "watermill_inbox_retention_window_seconds", "watermill_inbox_partition_lead_seconds"); err != nil || n != 0 {
		t.Fatalf("a table without retention or partitions: %d retention and lead series, %v; want none", n, err)
	}
}

func mustPartitions(t *testing.T, s *pgstore.Store) []pgstore.Partition {
	t.Helper()
	parts, err := s.Partitions(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return parts
}
