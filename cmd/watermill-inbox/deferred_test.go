package main

import (
	"context"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
)

// TestDeferredMigrateReplayStats: migrate creates the table once; replay by key resets a done
// row to pending (asserted on the row), stats counts it; bad input is refused.
func TestDeferredMigrateReplayStats(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	db := []string{"--database-url", testenv.DatabaseURL(), "--schema", sch.Name}
	out, err := run(t, append([]string{"deferred", "migrate"}, db...)...)
	if err != nil || !strings.Contains(out, "applied migrations [1]") {
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
