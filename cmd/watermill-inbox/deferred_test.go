package main

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestDeferredMigrateReplayStats: migrate creates the table once; replay by key resets a done
// row to pending (asserted on the row), stats counts it; bad input is refused.
func TestDeferredMigrateReplayStats(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	db := []string{"--database-url", testenv.DatabaseURL(), "--schema", sch.Name}
	out, err := run(t, append([]string{"deferred", "migrate"}, db...)...)
	if err != nil || !strings.Contains(out, "applied migrations [1 2]") {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	if out, err = run(t, append([]string{"deferred", "migrate"}, db...)...); err != nil || !strings.Contains(out, "up to date") {
		t.Fatalf("second migrate: %v\n%s", err, out)
	}
	ib, err := deferred.New(deferred.Config{Pool: sch.Pool, Schema: sch.Name, ConsumerName: "billing"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"pay-1", "pay-2"} {
		if err := ib.Receive(message.NewMessage(id, []byte(`{}`))); err != nil {
			t.Fatal(err)
		}
	}
	sch.Exec(t, "UPDATE inbox_deferred SET status = 'done', done_at = now()")
	if _, err := run(t, append([]string{"deferred", "replay", "--consumer", "billing"}, db...)...); err == nil {
		t.Fatal("replay without a selector was accepted")
	}
	if _, err := run(t, append([]string{"deferred", "replay", "--consumer", "billing", "--status", "pending"}, db...)...); err == nil {
		t.Fatal("replay of pending rows was accepted")
	}
	out, err = run(t, append([]string{"deferred", "replay", "--consumer", "billing", "--key", "pay-2"}, db...)...)
	if err != nil || !strings.Contains(out, "1 rows") {
		t.Fatalf("replay: %v\n%s", err, out)
	}
	var status string
	if err := sch.Pool.QueryRow(context.Background(), "SELECT string_agg(message_id || '=' || status, ',' ORDER BY message_id) FROM inbox_deferred").Scan(&status); err != nil || status != "pay-1=done,pay-2=pending" {
		t.Fatalf("rows %q, %v", status, err)
	}
	out, err = run(t, append([]string{"deferred", "stats", "--consumer", "billing"}, db...)...)
	if err != nil || !strings.Contains(out, "pending 1") {
		t.Fatalf("stats: %v\n%s", err, out)
	}
	if _, err := run(t, "deferred", "migrate", "--print", "--table", "bad-name"); err == nil {
		t.Fatal("an unsafe table name was accepted")
	}
}

// TestDeferredPurge: --dry-run reports the consumer's expired done rows and changes nothing;
// a purge while another holds the lock exits with status 3 and deletes nothing; the purge then
// deletes exactly those rows (with progress on standard error) and keeps done rows inside the
// window, pending and dead rows however old, and other consumers' rows.
func TestDeferredPurge(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	db := []string{"--database-url", testenv.DatabaseURL(), "--schema", sch.Name}
	if out, err := run(t, append([]string{"deferred", "migrate"}, db...)...); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	sch.Exec(t, `INSERT INTO inbox_deferred (message_id, consumer_name, message_uuid, payload, payload_hash, status, done_at, dead_at)
		SELECT 'k' || g, CASE WHEN g <= 40 THEN 'billing' ELSE 'shipping' END, 'k' || g, '\x00', '\x00',
		  CASE WHEN g <= 30 OR g > 40 THEN 'done' WHEN g <= 35 THEN 'pending' ELSE 'dead' END,
		  CASE WHEN g <= 12 OR g > 40 THEN now() - interval '20 days' WHEN g <= 30 THEN now() - interval '13 days' END,
		  CASE WHEN g BETWEEN 36 AND 40 THEN now() - interval '90 days' END
		FROM generate_series(1, 45) g`)
	total := func() int64 { return rowCount(t, sch, "SELECT count(*) FROM inbox_deferred") }
	purge := append([]string{"deferred", "purge", "--consumer", "billing", "--window", "14d", "--batch-size", "5", "--pause", "1ms"}, db...)
	out, err := run(t, append(purge, "--dry-run")...)
	if err != nil || !strings.Contains(out, "total: would delete 12 rows") || total() != 45 {
		t.Fatalf("purge --dry-run: %v, %d rows left\n%s", err, total(), out)
	}

	holder, err := sch.Pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	held := true
	t.Cleanup(func() {
		if held {
			holder.Release()
		}
	})
	lock := "watermill-inbox:deferred-purge:" + `"` + sch.Name + `"."inbox_deferred":billing`
	if _, err := holder.Exec(context.Background(), "SELECT pg_advisory_lock(hashtextextended($1, 0))", lock); err != nil {
		t.Fatal(err)
	}
	_, err = run(t, purge...)
	if exitCode(err) != exitBusy || !errors.Is(err, pgstore.ErrPurgeInProgress) || total() != 45 {
		t.Fatalf("purge beside another: %v (exit %d), %d rows left", err, exitCode(err), total())
	}
	if _, err := holder.Exec(context.Background(), "SELECT pg_advisory_unlock(hashtextextended($1, 0))", lock); err != nil {
		t.Fatal(err)
	}
	holder.Release()
	held = false

	out, err = run(t, purge...)
	if err != nil || !strings.Contains(out, "total: deleted 12 rows") || !strings.Contains(out, "rows deleted in 3 batches done") {
		t.Fatalf("purge: %v\n%s", err, out)
	}
	if n := rowCount(t, sch, "SELECT count(*) FROM inbox_deferred WHERE consumer_name = 'billing' AND status = 'done'"); n != 18 || total() != 33 {
		t.Fatalf("after the purge: %d billing done rows (want 18 inside the window), %d rows in all (want 33)", n, total())
	}
	if n := rowCount(t, sch, "SELECT count(*) FROM inbox_deferred WHERE status IN ('pending', 'dead') OR consumer_name = 'shipping'"); n != 15 {
		t.Fatalf("%d pending, dead and other consumers' rows, want 15", n)
	}
}

// TestDeferredPurgeRefusesBadInput: bad flags and settings exit with status 2 before anything
// changes, and a password is never printed.
func TestDeferredPurgeRefusesBadInput(t *testing.T) {
	t.Setenv("INBOX_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--window", "14d", "--bogus"}, "unknown flag"},
		{[]string{"--window", "14d"}, "--consumer is required"},
		{[]string{"--consumer", "billing"}, "--window is required"},
		{[]string{"--consumer", "billing", "--window", "fortnight"}, "want a duration"},
		{[]string{"--consumer", "billing", "--window", "3d"}, "shorter than the longest redelivery window"},
		{[]string{"--consumer", "billing", "--window", "14d"}, "no database URL"},
		{[]string{"--consumer", "billing", "--window", "14d", "--batch-size", "0"}, "--batch-size"},
		{[]string{"--consumer", "billing", "--window", "14d", "--topic", "bad-topic"}, "watermill topic"},
		{[]string{"--consumer", "billing", "--window", "14d", "--table", "bad-name", "--database-url", "postgres://x"}, "table name"},
		{[]string{"--consumer", "billing", "--window", "14d", "--database-url", "postgres://app:hunter2secret@127.0.0.1:5432/test?sslmode=nonsense"}, "database URL"},
		{[]string{"extra-arg", "--consumer", "billing", "--window", "14d"}, "unknown command"},
	} {
		out, err := run(t, append([]string{"deferred", "purge"}, c.args...)...)
		if err == nil || exitCode(err) != exitUsage || !strings.Contains(err.Error()+out, c.want) {
			t.Errorf("%v: exit %d, %v\n%s\nwant exit %d and %q", c.args, exitCode(err), err, out, exitUsage, c.want)
		}
		if strings.Contains(out, "hunter2secret") || (err != nil && strings.Contains(err.Error(), "hunter2secret")) {
			t.Errorf("%v printed the password: %v\n%s", c.args, err, out)
		}
	}
}

// TestDeferredStatsStuckAggregates: stats counts the aggregates whose head has waited longer
// than --stuck-after, in the consumer's order: with producer sequences a gap (1 done, 3 pending
// for an hour) and a dead head holding a pending row are stuck; a fresh head, a head in
// processing and a dead row with nothing behind it are not. By arrival order the same two are
// (the gap's head, 3, has waited an hour unclaimed); when dead rows do not hold their
// aggregate, only the gap is. A consumer name with a control character is refused before
// connecting.
func TestDeferredStatsStuckAggregates(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	db := []string{"--database-url", testenv.DatabaseURL(), "--schema", sch.Name}
	if out, err := run(t, append([]string{"deferred", "migrate"}, db...)...); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	sch.Exec(t, `INSERT INTO inbox_deferred (message_id, consumer_name, message_uuid, aggregate_key, producer_seq, payload, payload_hash, status, received_at)
		VALUES ('gap-1', 'billing', 'gap-1', 'gap', 1, '\x00', '\x00', 'done', now() - interval '2 hours'),
		       ('gap-3', 'billing', 'gap-3', 'gap', 3, '\x00', '\x00', 'pending', now() - interval '1 hour'),
		       ('fresh-1', 'billing', 'fresh-1', 'fresh', 1, '\x00', '\x00', 'pending', now()),
		       ('busy-1', 'billing', 'busy-1', 'busy', 1, '\x00', '\x00', 'processing', now() - interval '1 hour'),
		       ('busy-2', 'billing', 'busy-2', 'busy', 2, '\x00', '\x00', 'pending', now() - interval '1 hour'),
		       ('held-1', 'billing', 'held-1', 'held', 1, '\x00', '\x00', 'dead', now() - interval '1 hour'),
		       ('held-2', 'billing', 'held-2', 'held', 2, '\x00', '\x00', 'pending', now()),
		       ('alone-1', 'billing', 'alone-1', 'alone', 1, '\x00', '\x00', 'dead', now() - interval '1 hour')`)
	stats := append([]string{"deferred", "stats", "--consumer", "billing", "--stuck-after", "1m"}, db...)
	out, err := run(t, append(stats, "--sequence-field", "seq")...)
	if err != nil || !strings.Contains(out, "stuck aggregates 2 (head waiting over 1m0s)") {
		t.Fatalf("stats by sequence: %v\n%s", err, out)
	}
	if out, err = run(t, stats...); err != nil || !strings.Contains(out, "stuck aggregates 2 ") {
		t.Fatalf("stats by arrival: %v\n%s", err, out)
	}
	if out, err = run(t, append(stats, "--sequence-field", "seq", "--continue-after-dead")...); err != nil || !strings.Contains(out, "stuck aggregates 1 ") {
		t.Fatalf("stats by sequence, dead rows not holding: %v\n%s", err, out)
	}
	var uerr usageError
	if _, err := run(t, append([]string{"deferred", "stats", "--consumer", "bill\ning"}, db...)...); !errors.As(err, &uerr) {
		t.Fatalf("a consumer name with a newline: %v, want a usage error", err)
	}
}
