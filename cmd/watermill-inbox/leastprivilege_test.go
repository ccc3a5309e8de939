package main

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxmetrics"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestApplicationRoleRunsWhatTheDocsGiveIt: on every layout (text, compact, each partitioned),
// a role holding exactly what `grants --outbox --deferred` prints, and no CREATE anywhere,
// runs every command docs/security.md and docs/retention.md give the application role, and
// each changes the rows it should: migrate and deferred migrate with nothing pending, stats,
// dead list, dead replay (the dead letter is gone), purge with the outbox topic (the expired
// processed rows, attempt records, dead letters and consumed outbox rows are gone), layout
// show, deferred stats, replay and purge, and the table gauges (inboxmetrics.TableCollector). Partition maintenance is the owner's (no grant lets
// another role create or attach a partition): as the application role `partitions ensure`
// and `partitions drop`, and EnsurePartitions, DropPartitions and the PartitionManager, fail
// with ErrPartitionOwner saying so, create nothing and drop nothing; as the owner they run.
func TestApplicationRoleRunsWhatTheDocsGiveIt(t *testing.T) {
	for _, tc := range []struct {
		name   string
		layout pgstore.Layout
		part   *pgstore.Partitioning
	}{
		{"text", pgstore.LayoutText, nil},
		{"compact", pgstore.LayoutCompact, nil},
		{"text partitioned daily", pgstore.LayoutText, &pgstore.Partitioning{Interval: pgstore.PartitionDaily, ProducerTime: pgstore.ProducerTimeFromKey}},
		{"compact partitioned hourly", pgstore.LayoutCompact, &pgstore.Partitioning{Interval: pgstore.PartitionHourly, ProducerTime: pgstore.ProducerTimeFromKey}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			sch := testenv.NewSchema(t, 2)
			owner := []string{"--database-url", testenv.DatabaseURL(), "--schema", sch.Name}
			layoutName := map[pgstore.Layout]string{pgstore.LayoutText: "text", pgstore.LayoutCompact: "compact"}[tc.layout]
			cfg := pgstore.Config{Schema: sch.Name, Layout: tc.layout, Partitioning: tc.part}
			ownerStore, err := pgstore.New(sch.Pool, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := ownerStore.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			for _, args := range [][]string{{"migrate", "--outbox"}, {"deferred", "migrate"}} {
				if out, err := run(t, append(args, owner...)...); err != nil {
					t.Fatalf("%v as the owner: %v\n%s", args, err, out)
				}
			}
			_, roleURL := testenv.GrantedRole(t, sch, func(role string) (string, error) {
				return run(t, "grants", "--role", role, "--schema", sch.Name, "--layout", layoutName, "--outbox", "--deferred")
			})
			app := []string{"--database-url", roleURL, "--schema", sch.Name}
			count := func(q string) int64 { return rowCount(t, sch, q) }

			// What the purge and the replay work on, written as the owner: expired processed
			// rows (unpartitioned tables only: a partitioned table holds only its partitions'
			// periods), attempt records, dead letters, consumed outbox rows.
			if tc.part == nil {
				if tc.layout == pgstore.LayoutText {
					sch.Exec(t, "INSERT INTO inbox_processed_messages (message_id, consumer_name, received_at) SELECT 'old' || g, 'billing', now() - interval '20 days' FROM generate_series(1, 3) g")
				}
			}
			sch.Exec(t, "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, last_attempt_at, dead_lettered_at, dead_letter_reason) VALUES ('d-old', 'billing', now() - interval '40 days', now() - interval '31 days', 'r'), ('d-new', 'billing', now(), now(), 'r')")
			sch.Exec(t, "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, last_attempt_at) VALUES ('a-old', 'billing', now() - interval '15 days')")
			sch.Exec(t, `INSERT INTO watermill_inbox_outbox ("offset", uuid, created_at, payload, transaction_id)
				SELECT g, 'm' || g, (CURRENT_TIMESTAMP - interval '20 days')::timestamp, '{}', (100 + g)::text::xid8 FROM generate_series(1, 4) g`)
			sch.Exec(t, `INSERT INTO watermill_offsets_inbox_outbox (consumer_group, offset_acked, last_processed_transaction_id) VALUES ('relay', 4, '104')`)

			for _, args := range [][]string{
				{"migrate", "--outbox"},
				{"deferred", "migrate"},
				{"stats"},
				{"dead", "list"},
				{"layout", "show"},
				{"deferred", "stats", "--consumer", "billing"},
				{"deferred", "replay", "--consumer", "billing", "--all"},
				{"deferred", "purge", "--consumer", "billing", "--window", "14d"},
			} {
				if out, err := run(t, append(args, app...)...); err != nil {
					t.Errorf("%v as the application role: %v\n%s", args, err, out)
				}
			}
			if out, err := run(t, append([]string{"dead", "replay", "--consumer", "billing", "--since", "1h"}, app...)...); err != nil {
				t.Errorf("dead replay as the application role: %v\n%s", err, out)
			}
			if n := count("SELECT count(*) FROM inbox_processed_messages_attempts WHERE message_id = 'd-new'"); n != 0 {
				t.Errorf("dead replay as the application role left the dead letter (%d)", n)
			}
			purge := []string{"purge", "--window", "14d", "--max-redelivery", "7d", "--topic", "inbox_outbox", "--topic-schema", sch.Name, "--pause", "1ms"}
			if out, err := run(t, append(purge, app...)...); err != nil {
				t.Errorf("purge --topic as the application role: %v\n%s", err, out)
			}
			expired := "SELECT (SELECT count(*) FROM inbox_processed_messages_attempts WHERE message_id IN ('a-old', 'd-old')) + (SELECT count(*) FROM watermill_inbox_outbox)"
			if tc.part == nil && tc.layout == pgstore.LayoutText {
				expired += " + (SELECT count(*) FROM inbox_processed_messages WHERE received_at < now() - interval '14 days')"
			}
			if n := count(expired); n != 0 {
				t.Errorf("purge as the application role left %d expired rows", n)
			}

			// The table gauges (inboxmetrics.TableCollector), which docs/observability.md has
			// the application scrape, read as the application role, outbox backlog included.
			appStore, err := pgstore.New(testenv.NewPool(t, roleURL, 2), cfg)
			if err != nil {
				t.Fatal(err)
			}
			tables, err := inboxmetrics.NewTableCollector(appStore, inboxmetrics.TableConfig{Outbox: &inboxmetrics.OutboxTables{Schema: sch.Name, ConsumerGroup: "relay"}})
			if err != nil {
				t.Fatal(err)
			}
			if st, err := tables.Read(ctx); err != nil || st.OutboxBacklog != 0 {
				t.Errorf("the table collector as the application role: %+v, %v", st, err)
			}
			if tc.part == nil {
				return
			}
			if out, err := run(t, append([]string{"partitions", "list"}, append(app, "--interval", tc.part.Interval.String())...)...); err != nil {
				t.Errorf("partitions list as the application role: %v\n%s", err, out)
			}
			// Older partitions, for the drop to find (as the owner).
			if out, err := run(t, append([]string{"partitions", "ensure", "--back", "72h"}, append(owner, "--interval", tc.part.Interval.String())...)...); err != nil {
				t.Fatalf("partitions ensure --back 72h as the owner: %v\n%s", err, out)
			}
			parts := func() int64 {
				return count("SELECT count(*) FROM pg_inherits WHERE inhparent = '" + sch.Name + ".inbox_processed_messages'::regclass")
			}
			before := parts()
			for _, args := range [][]string{{"partitions", "ensure", "--lead", "240h"}, {"partitions", "drop", "--older-than", "1h"}} {
				out, err := run(t, append(args, append(app, "--interval", tc.part.Interval.String())...)...)
				if exitCode(err) != exitError || !strings.Contains(out, "the table's owner") {
					t.Errorf("%v as the application role: exit %d, %v; want exit 1 naming the table's owner\n%s", args, exitCode(err), err, out)
				}
			}
			now := time.Now()
			if _, err := appStore.EnsurePartitions(ctx, now, now.Add(240*time.Hour)); !errors.Is(err, pgstore.ErrPartitionOwner) {
				t.Errorf("EnsurePartitions as the application role: %v, want ErrPartitionOwner", err)
			}
			if _, err := appStore.DropPartitions(ctx, now.Add(time.Hour)); !errors.Is(err, pgstore.ErrPartitionOwner) {
				t.Errorf("DropPartitions as the application role: %v, want ErrPartitionOwner", err)
			}
			pm, err := pgstore.NewPartitionManager(appStore, pgstore.PartitionManagerConfig{Retention: 48 * time.Hour, Lead: 240 * time.Hour}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := pm.RunOnce(ctx); !errors.Is(err, pgstore.ErrPartitionOwner) {
				t.Errorf("PartitionManager.RunOnce as the application role: %v, want ErrPartitionOwner", err)
			}
			if after := parts(); after != before {
				t.Fatalf("the application role changed the partitions: %d, was %d", after, before)
			}
			if out, err := run(t, append([]string{"partitions", "ensure", "--lead", "240h"}, append(owner, "--interval", tc.part.Interval.String())...)...); err != nil || parts() <= before {
				t.Fatalf("partitions ensure as the owner: %v, %d partitions, was %d\n%s", err, parts(), before, out)
			}
		})
	}
}
