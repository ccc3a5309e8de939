package main

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// The reasons of the seeded dead letters.
const (
	reasonFrozen  = "failed 5 of 5 attempts; last error: account frozen"
	reasonTooOld  = "older than the retention window"
	reasonBadData = "permanent error: bad data"
)

// seedDeadLetters migrates an inbox table and fills its attempts table with one incident per
// reason, plus a record that is not dead-lettered:
//
//	billing   frozen   f1 3h ago, f2 2h ago, f3 90min ago
//	billing   too old  o1 30min ago, o2 10min ago
//	billing   bad data b1 5h ago
//	shipping  frozen   s1, s2 1h ago
//	billing   live     (attempts pending, not dead-lettered)
func seedDeadLetters(t *testing.T) (*testenv.Schema, []string) {
	t.Helper()
	sch, conn := migrated(t)
	sch.Exec(t, `INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, attempts, dead_lettered_at, dead_letter_reason) VALUES
		('f1', 'billing', 5, now() - interval '3 hours', '`+reasonFrozen+`'),
		('f2', 'billing', 5, now() - interval '2 hours', '`+reasonFrozen+`'),
		('f3', 'billing', 5, now() - interval '90 minutes', '`+reasonFrozen+`'),
		('o1', 'billing', 0, now() - interval '30 minutes', '`+reasonTooOld+`'),
		('o2', 'billing', 0, now() - interval '10 minutes', '`+reasonTooOld+`'),
		('b1', 'billing', 1, now() - interval '5 hours', '`+reasonBadData+`'),
		('s1', 'shipping', 5, now() - interval '1 hour', '`+reasonFrozen+`'),
		('s2', 'shipping', 5, now() - interval '1 hour', '`+reasonFrozen+`')`)
	sch.Exec(t, "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, attempts) VALUES ('live', 'billing', 2)")
	return sch, conn
}

// deadKeys returns the keys still dead-lettered, sorted, as "consumer/key".
func deadKeys(t *testing.T, sch *testenv.Schema) string {
	t.Helper()
	var s string
	if err := sch.Pool.QueryRow(t.Context(), "SELECT coalesce(string_agg(consumer_name || '/' || message_id, ' ' ORDER BY consumer_name, message_id), '') FROM inbox_processed_messages_attempts WHERE dead_lettered_at IS NOT NULL").Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

const allDead = "billing/b1 billing/f1 billing/f2 billing/f3 billing/o1 billing/o2 shipping/s1 shipping/s2"

// TestDeadListGroupsByReason: dead list groups by consumer and reason, with the count and the
// first and last time, the group first seen first; --reason, --since and --until select; and
// --records still lists each record.
func TestDeadListGroupsByReason(t *testing.T) {
	_, conn := seedDeadLetters(t)
	out, err := run(t, append([]string{"dead", "list", "--json"}, conn...)...)
	var groups []pgstore.DeadLetterReason
	if err != nil || json.Unmarshal([]byte(out), &groups) != nil {
		t.Fatalf("dead list --json: %v\n%s", err, out)
	}
	type g struct {
		consumer, reason string
		count            int64
	}
	want := []g{{"billing", reasonBadData, 1}, {"billing", reasonFrozen, 3}, {"shipping", reasonFrozen, 2}, {"billing", reasonTooOld, 2}}
	if len(groups) != len(want) {
		t.Fatalf("dead list: %d groups, want %d\n%s", len(groups), len(want), out)
	}
	for i, w := range want {
		if got := (g{groups[i].ConsumerName, groups[i].Reason, groups[i].Count}); got != w {
			t.Errorf("group %d = %+v, want %+v", i, got, w)
		}
	}
	near := func(at time.Time, ago time.Duration) bool {
		d := time.Since(at) - ago
		return d > -time.Minute && d < time.Minute
	}
	if frozen := groups[1]; !near(frozen.FirstSeen, 3*time.Hour) || !near(frozen.LastSeen, 90*time.Minute) {
		t.Errorf("billing's frozen group: first %s, last %s; want 3h and 90min ago", frozen.FirstSeen, frozen.LastSeen)
	}

	out, err = run(t, append([]string{"dead", "list", "--consumer", "billing", "--since", "4h", "--until", "1h"}, conn...)...)
	if err != nil || strings.Count(out, "\n") != 2 || !strings.Contains(out, `"billing"	reason="`+reasonFrozen+`"	count=3	first=`) ||
		!strings.Contains(out, "3 dead-lettered in 1 groups") {
		t.Fatalf("dead list --consumer billing --since 4h --until 1h: %v\n%s", err, out)
	}
	out, err = run(t, append([]string{"dead", "list", "--reason", reasonFrozen}, conn...)...)
	if err != nil || !strings.Contains(out, "5 dead-lettered in 2 groups") || strings.Contains(out, reasonTooOld) {
		t.Fatalf("dead list --reason: %v\n%s", err, out)
	}
	out, err = run(t, append([]string{"dead", "list", "--records", "--reason", reasonTooOld, "--json"}, conn...)...)
	var recs []pgstore.DeadLetterRecord
	if err != nil || json.Unmarshal([]byte(out), &recs) != nil || len(recs) != 2 || recs[0].MessageID != "o1" || recs[1].MessageID != "o2" {
		t.Fatalf("dead list --records --reason --json: %v\n%s", err, out)
	}
}

// TestDeadReplayByReasonAndRange: a dry run prints the selection by reason and changes
// nothing; the replay then clears exactly the dead letters of that consumer, reason and time
// range, and no other record.
func TestDeadReplayByReasonAndRange(t *testing.T) {
	sch, conn := seedDeadLetters(t)
	replay := append([]string{"dead", "replay", "--consumer", "billing", "--reason", reasonFrozen, "--since", "150m"}, conn...)
	out, err := run(t, append(replay, "--dry-run")...)
	if err != nil || !strings.Contains(out, "would clear 2\treason=\""+reasonFrozen+"\"") || !strings.Contains(out, "dry run: would clear 2 dead letters") {
		t.Fatalf("dead replay --dry-run: %v\n%s", err, out)
	}
	if got := deadKeys(t, sch); got != allDead {
		t.Fatalf("the dry run changed the dead letters: %s", got)
	}
	out, err = run(t, replay...)
	if err != nil || !strings.Contains(out, "2 cleared") || !strings.Contains(out, `cleared "f2"`) || !strings.Contains(out, `cleared "f3"`) {
		t.Fatalf("dead replay --reason --since: %v\n%s", err, out)
	}
	if got, want := deadKeys(t, sch), "billing/b1 billing/f1 billing/o1 billing/o2 shipping/s1 shipping/s2"; got != want {
		t.Fatalf("dead letters after the replay: %s, want %s", got, want)
	}
	if n := rowCount(t, sch, "SELECT count(*) FROM inbox_processed_messages_attempts WHERE message_id IN ('f2', 'f3', 'live')"); n != 1 {
		t.Fatalf("%d records of f2, f3 and live left; want live's only", n)
	}
}

// TestDeadDiscardByReasonAndRange: a dry run prints the selection and changes nothing; the
// discard deletes exactly the dead letters of that consumer, reason and time range; one key
// can be discarded by name, and a key that is not dead-lettered is an error; records that are
// not dead-lettered are never touched.
func TestDeadDiscardByReasonAndRange(t *testing.T) {
	sch, conn := seedDeadLetters(t)
	discard := append([]string{"dead", "discard", "--consumer", "billing", "--reason", reasonTooOld, "--until", "20m"}, conn...)
	out, err := run(t, append(discard, "--dry-run")...)
	if err != nil || !strings.Contains(out, "would discard 1\treason=\""+reasonTooOld+"\"") || !strings.Contains(out, "nothing changed") {
		t.Fatalf("dead discard --dry-run: %v\n%s", err, out)
	}
	if got := deadKeys(t, sch); got != allDead {
		t.Fatalf("the dry run changed the dead letters: %s", got)
	}
	if out, err = run(t, discard...); err != nil || !strings.Contains(out, `1 discarded for consumer "billing"`) {
		t.Fatalf("dead discard --reason --until: %v\n%s", err, out)
	}
	if got, want := deadKeys(t, sch), "billing/b1 billing/f1 billing/f2 billing/f3 billing/o2 shipping/s1 shipping/s2"; got != want {
		t.Fatalf("dead letters after the discard: %s, want %s", got, want)
	}
	// Every frozen dead letter of billing, whatever its time; shipping's stay.
	if out, err = run(t, append([]string{"dead", "discard", "--consumer", "billing", "--reason", reasonFrozen}, conn...)...); err != nil || !strings.Contains(out, "3 discarded") {
		t.Fatalf("dead discard --reason: %v\n%s", err, out)
	}
	if out, err = run(t, append([]string{"dead", "discard", "b1", "--consumer", "billing"}, conn...)...); err != nil || !strings.Contains(out, "1 discarded") {
		t.Fatalf("dead discard b1: %v\n%s", err, out)
	}
	if _, err = run(t, append([]string{"dead", "discard", "live", "--consumer", "billing"}, conn...)...); err == nil || exitCode(err) != exitError {
		t.Fatalf("discarding a record that is not dead-lettered: %v (exit %d), want exit 1", err, exitCode(err))
	}
	if got, want := deadKeys(t, sch), "billing/o2 shipping/s1 shipping/s2"; got != want {
		t.Fatalf("dead letters left: %s, want %s", got, want)
	}
	if n := rowCount(t, sch, "SELECT count(*) FROM inbox_processed_messages_attempts WHERE message_id = 'live' AND attempts = 2"); n != 1 {
		t.Fatal("the record that is not dead-lettered was touched")
	}
}

// TestDeadCommandsRefuseBadSelections: replay and discard need --consumer and exactly one of
// a key and a selection; --since must be before --until; all before connecting.
func TestDeadCommandsRefuseBadSelections(t *testing.T) {
	t.Setenv("INBOX_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"dead", "discard", "--reason", "r"}, "--consumer is required"},
		{[]string{"dead", "discard", "k1", "--consumer", "billing", "--reason", "r"}, "not both and not neither"},
		{[]string{"dead", "discard", "--consumer", "billing"}, "not both and not neither"},
		{[]string{"dead", "replay", "k1", "--consumer", "billing", "--since", "1h"}, "not both and not neither"},
		{[]string{"dead", "replay", "--consumer", "billing", "--since", "1h", "--until", "2h"}, "--since must be before --until"},
		{[]string{"dead", "list", "--until", "yesterday"}, "--until"},
	} {
		out, err := run(t, c.args...)
		if err == nil || exitCode(err) != exitUsage || !strings.Contains(err.Error()+out, c.want) {
			t.Errorf("%v: exit %d, %v\n%s\nwant exit %d and %q", c.args, exitCode(err), err, out, exitUsage, c.want)
		}
	}
}
