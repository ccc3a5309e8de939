package main

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

func migrated(t *testing.T) (*testenv.Schema, []string) {
	t.Helper()
	sch := testenv.NewSchema(t, 2)
	conn := []string{"--database-url", testenv.DatabaseURL(), "--schema", sch.Name}
	if out, err := run(t, append([]string{"migrate", "--outbox"}, conn...)...); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	return sch, conn
}

func rowCount(t *testing.T, sch *testenv.Schema, q string) int64 {
	t.Helper()
	var n int64
	if err := sch.Pool.QueryRow(context.Background(), q).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestPurgeCommand: --dry-run reports what would go and changes nothing; the purge then
// deletes exactly that (processed rows and attempt records past 14 days, dead-lettered past
// 30, outbox rows consumed and past 14 days) and keeps everything inside the windows; a purge
// while another holds the table's purge lock exits with status 3 and deletes nothing.
func TestPurgeCommand(t *testing.T) {
	sch, conn := migrated(t)
	sch.Exec(t, "INSERT INTO inbox_processed_messages (message_id, consumer_name, received_at) SELECT 'old' || g, 'billing', now() - interval '20 days' FROM generate_series(1, 12) g")
	sch.Exec(t, "INSERT INTO inbox_processed_messages (message_id, consumer_name, received_at) SELECT 'new' || g, 'billing', now() - interval '13 days' FROM generate_series(1, 5) g")
	sch.Exec(t, "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, last_attempt_at, dead_lettered_at, dead_letter_reason) VALUES ('d-old', 'billing', now() - interval '40 days', now() - interval '31 days', 'r'), ('d-new', 'billing', now() - interval '40 days', now() - interval '29 days', 'r')")
	sch.Exec(t, "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, last_attempt_at) VALUES ('a-old', 'billing', now() - interval '15 days'), ('a-new', 'billing', now())")
	sch.Exec(t, `INSERT INTO watermill_inbox_outbox ("offset", uuid, created_at, payload, transaction_id)
		SELECT g, 'm' || g, (CURRENT_TIMESTAMP - interval '20 days')::timestamp, '{}', (100 + g)::text::xid8 FROM generate_series(1, 6) g`)
	sch.Exec(t, `INSERT INTO watermill_offsets_inbox_outbox (consumer_group, offset_acked, last_processed_transaction_id) VALUES ('relay', 4, '104')`)
	total := func() int64 {
		return rowCount(t, sch, "SELECT (SELECT count(*) FROM inbox_processed_messages) + (SELECT count(*) FROM inbox_processed_messages_attempts) + (SELECT count(*) FROM watermill_inbox_outbox)")
	}
	before := total()
	purge := append([]string{"purge", "--window", "14d", "--max-redelivery", "7d", "--topic", "inbox_outbox", "--topic-schema", sch.Name, "--batch-size", "5", "--pause", "1ms"}, conn...)
	out, err := run(t, append(purge, "--dry-run")...)
	if err != nil || !strings.Contains(out, "total: would delete 18 rows") {
		t.Fatalf("purge --dry-run: %v\n%s", err, out)
	}
	if total() != before {
		t.Fatalf("--dry-run changed the tables: %d rows, was %d", total(), before)
	}

	// Another purger holds the lock: exit status 3, nothing deleted.
	holder, err := sch.Pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	held := true
	t.Cleanup(func() { // on a failure, before the pool closes
		if held {
			holder.Release()
		}
	})
	lock := "watermill-inbox:purge:" + `"` + sch.Name + `"."inbox_processed_messages"`
	if _, err := holder.Exec(context.Background(), "SELECT pg_advisory_lock(hashtextextended($1, 0))", lock); err != nil {
		t.Fatal(err)
	}
	_, err = run(t, purge...)
	if exitCode(err) != exitBusy || !errors.Is(err, pgstore.ErrPurgeInProgress) || total() != before {
		t.Fatalf("purge beside another: %v (exit %d), %d rows left of %d", err, exitCode(err), total(), before)
	}
	if _, err := holder.Exec(context.Background(), "SELECT pg_advisory_unlock(hashtextextended($1, 0))", lock); err != nil {
		t.Fatal(err)
	}
	holder.Release()
	held = false

	out, err = run(t, purge...)
	if err != nil || !strings.Contains(out, "total: deleted 18 rows") || !strings.Contains(out, "rows deleted in 3 batches done") {
		t.Fatalf("purge: %v\n%s", err, out)
	}
	if n := rowCount(t, sch, "SELECT count(*) FROM inbox_processed_messages WHERE message_id LIKE 'new%'"); n != 5 || total() != before-18 {
		t.Fatalf("after the purge: %d rows inside the window (want 5), %d rows in all (want %d)", n, total(), before-18)
	}
	if n := rowCount(t, sch, "SELECT count(*) FROM inbox_processed_messages_attempts WHERE message_id IN ('d-new', 'a-new')"); n != 2 {
		t.Fatalf("records inside their windows left: %d, want 2", n)
	}
	if n := rowCount(t, sch, "SELECT count(*) FROM watermill_inbox_outbox"); n != 2 {
		t.Fatalf("outbox rows left: %d, want the 2 the relay has not consumed", n)
	}
}

// TestStatsAndDeadCommands: stats counts rows, consumers and attempt records (text and
// JSON); dead list shows the dead letters with reason and attempts; dead replay clears one
// key, refuses a key that is not dead-lettered, and clears the rest with --since.
func TestStatsAndDeadCommands(t *testing.T) {
	sch, conn := migrated(t)
	sch.Exec(t, "INSERT INTO inbox_processed_messages (message_id, consumer_name) SELECT 'k' || g, CASE WHEN g <= 3 THEN 'billing' ELSE 'shipping' END FROM generate_series(1, 10) g")
	sch.Exec(t, "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, attempts, dead_lettered_at, dead_letter_reason) VALUES ('p1', 'billing', 5, now() - interval '2 hours', 'failed 5 of 5 attempts'), ('p2', 'billing', 0, now(), 'older than the retention window'), ('p3', 'shipping', 2, now(), 'permanent error: bad')")
	sch.Exec(t, "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name) VALUES ('live', 'billing')")

	out, err := run(t, append([]string{"stats", "--json"}, conn...)...)
	if err != nil {
		t.Fatalf("stats --json: %v\n%s", err, out)
	}
	var st pgstore.TableStats
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("stats --json is not JSON: %v\n%s", err, out)
	}
	if st.Rows != 10 || st.PerConsumer["billing"] != 3 || st.PerConsumer["shipping"] != 7 || st.AttemptsPending != 1 || st.DeadLettered != 3 ||
		st.HeapBytes <= 0 || st.IndexBytes <= 0 || st.BytesPerRow <= 0 || st.Oldest == nil {
		t.Fatalf("stats = %+v", st)
	}
	if out, err = run(t, append([]string{"stats"}, conn...)...); err != nil || !strings.Contains(out, "bytes per row") || !strings.Contains(out, `"shipping": 7 rows`) {
		t.Fatalf("stats: %v\n%s", err, out)
	}

	out, err = run(t, append([]string{"dead", "list", "--records", "--consumer", "billing", "--json"}, conn...)...)
	var recs []pgstore.DeadLetterRecord
	if err != nil || json.Unmarshal([]byte(out), &recs) != nil || len(recs) != 2 || recs[0].MessageID != "p1" || recs[0].Attempts != 5 || recs[1].Reason != "older than the retention window" {
		t.Fatalf("dead list --json: %v\n%s", err, out)
	}
	if out, err = run(t, append([]string{"dead", "list", "--records", "--since", "1h"}, conn...)...); err != nil || strings.Contains(out, "p1") || !strings.Contains(out, "p3") {
		t.Fatalf("dead list --since 1h: %v\n%s", err, out)
	}

	if out, err = run(t, append([]string{"dead", "replay", "p1", "--consumer", "billing"}, conn...)...); err != nil || !strings.Contains(out, "1 cleared") {
		t.Fatalf("dead replay p1: %v\n%s", err, out)
	}
	_, err = run(t, append([]string{"dead", "replay", "p1", "--consumer", "billing"}, conn...)...)
	if err == nil || exitCode(err) != exitError {
		t.Fatalf("replaying a key no longer dead-lettered: %v (exit %d), want exit 1", err, exitCode(err))
	}
	if out, err = run(t, append([]string{"dead", "replay", "--consumer", "billing", "--since", "1h"}, conn...)...); err != nil || !strings.Contains(out, "1 cleared") {
		t.Fatalf("dead replay --since: %v\n%s", err, out)
	}
	left := rowCount(t, sch, "SELECT count(*) FROM inbox_processed_messages_attempts WHERE dead_lettered_at IS NOT NULL")
	if left != 1 || rowCount(t, sch, "SELECT count(*) FROM inbox_processed_messages_attempts WHERE message_id = 'live'") != 1 {
		t.Fatalf("after the replays: %d dead-lettered left (want shipping's 1), live record kept?", left)
	}
}

// TestRetentionCommandsRefuseBadInput: bad flags, a bad or unreachable URL, a window below the
// declared redelivery window, and a missing window each give a clear error and a non-zero
// exit status, and the URL's password is never printed.
func TestRetentionCommandsRefuseBadInput(t *testing.T) {
	t.Setenv("INBOX_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"purge", "--window", "14d", "--bogus"}, exitUsage, "unknown flag"},
		{[]string{"purge", "--window", "fortnight"}, exitUsage, "want a duration"},
		{[]string{"purge"}, exitUsage, "--window is required"},
		{[]string{"purge", "--window", "3d"}, exitUsage, "shorter than the longest redelivery window"},
		{[]string{"purge", "--window", "14d"}, exitUsage, "no database URL"},
		{[]string{"purge", "--window", "14d", "--batch-size", "0", "--database-url", "postgres://x"}, exitUsage, "--batch-size"},
		{[]string{"purge", "--window", "14d", "--topic", "bad-topic", "--database-url", testenv.DatabaseURL()}, exitUsage, "watermill topic"},
		{[]string{"purge", "--window", "14d", "--database-url", "postgres://app:hunter2secret@127.0.0.1:5432/test?sslmode=nonsense"}, exitUsage, "database URL"},
		{[]string{"stats", "--database-url", "postgres://app:hunter2secret@127.0.0.1:1/test"}, exitError, "connect"},
		{[]string{"stats", "extra-arg"}, exitUsage, "unknown command"},
		{[]string{"dead", "list", "--since", "last tuesday"}, exitUsage, "--since"},
		{[]string{"dead", "replay", "k1"}, exitUsage, "--consumer is required"},
		{[]string{"dead", "replay", "--consumer", "billing"}, exitUsage, "one message ID, or select with --reason, --since or --until"},
		{[]string{"dead"}, exitUsage, "list, replay or discard"},
	} {
		out, err := run(t, c.args...)
		if err == nil || exitCode(err) != c.code || !strings.Contains(err.Error()+out, c.want) {
			t.Errorf("%v: exit %d, %v\n%s\nwant exit %d and %q", c.args, exitCode(err), err, out, c.code, c.want)
		}
		if strings.Contains(out, "hunter2secret") || (err != nil && strings.Contains(err.Error(), "hunter2secret")) {
			t.Errorf("%v printed the password: %v\n%s", c.args, err, out)
		}
	}
}
