package pgstore_test

import (
	"context"
	"strings"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestCompactReplayOfANonUUIDDeadLetter: a dead letter whose key the compact table cannot hold
// (kept in the attempts table from the text layout, which a conversion leaves as it is) is
// replayed, not refused with a uuid cast error, and its record is gone afterwards.
func TestCompactReplayOfANonUUIDDeadLetter(t *testing.T) {
	s, sch := layoutStore(t, 4, pgstore.Config{Layout: pgstore.LayoutCompact})
	ctx := context.Background()
	k := contract.Key{MessageID: "order-17", ConsumerName: "billing"}
	if err := s.MarkDeadLettered(ctx, k, "failed 3 of 3 attempts"); err != nil {
		t.Fatal(err)
	}
	if _, ok := attemptsRow(t, sch.Pool, s, k); !ok {
		t.Fatal("MarkDeadLettered left no record")
	}
	if ok, err := s.Replay(ctx, k); err != nil || !ok {
		t.Fatalf("Replay of a dead letter never processed = %v, %v; want true", ok, err)
	}
	if n, ok := attemptsRow(t, sch.Pool, s, k); ok {
		t.Fatalf("the replayed dead letter's record is still there (%d attempts)", n)
	}
	if ok, err := s.Replay(ctx, k); err != nil || ok {
		t.Fatalf("a second Replay = %v, %v; want false", ok, err)
	}
}

// TestMarkDeadLetteredKeepsTheCountAndTheReason: MarkDeadLettered of a key with attempts keeps
// its count and sets the reason (truncated to 1024 bytes); of a key without a record it
// creates one with no attempt; a claim of the key then counts nothing; Replay deletes exactly
// that key's dead-lettered record, after which the key runs again.
func TestMarkDeadLetteredKeepsTheCountAndTheReason(t *testing.T) {
	s, sch := layoutStore(t, 4, pgstore.Config{})
	ctx := context.Background()
	d := countedFirst(plain("m-dl", "billing"), true)
	tx, _ := mustClaim(t, s, d, contract.Run)
	if _, err := tx.Fail(ctx, contract.Failure{Counts: true, Error: "boom"}); err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("x", 2000)
	fresh := contract.Key{MessageID: "m-fresh", ConsumerName: "billing"}
	for _, k := range []contract.Key{d.Key, fresh} {
		if err := s.MarkDeadLettered(ctx, k, "reason "+long); err != nil {
			t.Fatal(err)
		}
	}
	type rec struct {
		attempts int
		reason   string
		dead     bool
	}
	read := func(id string) rec {
		var r rec
		if err := sch.Pool.QueryRow(ctx, "SELECT attempts, dead_letter_reason, dead_lettered_at IS NOT NULL FROM "+s.AttemptsTable()+
			" WHERE message_id = $1 AND consumer_name = 'billing'", id).Scan(&r.attempts, &r.reason, &r.dead); err != nil {
			t.Fatal(err)
		}
		return r
	}
	for id, attempts := range map[string]int{"m-dl": 1, "m-fresh": 0} {
		r := read(id)
		if r.attempts != attempts || !r.dead || len(r.reason) != 1024 || !strings.HasPrefix(r.reason, "reason ") {
			t.Fatalf("%s: %d attempts, dead %v, reason of %d bytes; want %d attempts, dead, 1024 bytes", id, r.attempts, r.dead, len(r.reason), attempts)
		}
	}
	for _, first := range []bool{true, false} {
		mustClaim(t, s, countedFirst(d, first), contract.DeadLettered)
	}
	if r := read("m-dl"); r.attempts != 1 {
		t.Fatalf("a dead-lettered claim counted: %d attempts", r.attempts)
	}
	if n := claimRows(t, sch.Pool, s, "m-dl"); n != 0 {
		t.Fatalf("a dead-lettered claim left %d rows", n)
	}
	if ok, err := s.Replay(ctx, d.Key); err != nil || !ok {
		t.Fatalf("Replay: %v %v", ok, err)
	}
	if _, ok := attemptsRow(t, sch.Pool, s, d.Key); ok {
		t.Fatal("Replay left the record")
	}
	if _, ok := attemptsRow(t, sch.Pool, s, fresh); !ok {
		t.Fatal("Replay of one key deleted another's record")
	}
	mustCommit(t, s, d)
	if n := claimRows(t, sch.Pool, s, "m-dl"); n != 1 {
		t.Fatalf("%d rows of the replayed key after its commit, want 1", n)
	}
}
