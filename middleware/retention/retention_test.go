package retention_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/middleware/retention"
)

var hourly = inbox.Retention{Window: 2 * time.Hour, MaxRedelivery: time.Hour, Margin: time.Hour}

func TestNewRefusesAStoreWithoutAWindow(t *testing.T) {
	sch := testenv.NewSchema(t, 1)
	if _, err := retention.New(sch.Store(t), retention.Config{}, nil); !errors.Is(err, pgstore.ErrNoRetention) {
		t.Fatalf("New on a store without a window: %v", err)
	}
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Retention: hourly})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := retention.New(s, retention.Config{Interval: -time.Second}, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("negative interval: %v", err)
	}
}

// TestRunPurgesInTheBackgroundUntilClose: Run purges at once and then every Interval (rows
// aged past the window after it started are purged by a later pass), rows inside the window
// stay, and Close stops it: Run returns nil and no pass follows.
func TestRunPurgesInTheBackgroundUntilClose(t *testing.T) {
	sch := testenv.NewSchema(t, 3)
	sch.Store(t) // migrated
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Retention: hourly})
	if err != nil {
		t.Fatal(err)
	}
	sch.Exec(t, "INSERT INTO inbox_processed_messages (message_id, consumer_name, received_at) SELECT 'old' || g, 'c', now() - interval '3 hours' FROM generate_series(1, 2500) g")
	sch.Exec(t, "INSERT INTO inbox_processed_messages (message_id, consumer_name) SELECT 'new' || g, 'c' FROM generate_series(1, 10) g")
	var mu sync.Mutex
	var passes []int64
	p, err := retention.New(s, retention.Config{Interval: 50 * time.Millisecond, BatchSize: 1000, OnPass: func(r pgstore.PurgeReport, err error) {
		if err != nil {
			t.Errorf("pass: %v", err)
		}
		mu.Lock()
		passes = append(passes, r.Rows())
		mu.Unlock()
	}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan error, 1)
	go func() { ran <- p.Run(context.Background()) }()
	<-p.Running()
	n := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(passes)
	}
	deadline := time.Now().Add(10 * time.Second)
	for n() < 1 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	// Ten more rows leave the window while it runs: a later pass takes them.
	sch.Exec(t, "UPDATE inbox_processed_messages SET received_at = now() - interval '5 hours' WHERE message_id IN ('new1', 'new2')")
	var left int
	for time.Now().Before(deadline) {
		if err := sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM inbox_processed_messages").Scan(&left); err != nil {
			t.Fatal(err)
		}
		if left == 8 && n() >= 2 { // the later pass deleted them and reported (OnPass runs after its commit)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-ran; err != nil {
		t.Fatalf("Run returned %v after Close", err)
	}
	after := n()
	time.Sleep(150 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if left != 8 || passes[0] != 2500 || len(passes) < 2 || len(passes) != after {
		t.Fatalf("rows left %d (want 8), passes %v (want 2500 first, then more, none after Close)", left, passes)
	}
	if err := p.Run(context.Background()); err == nil {
		t.Fatal("Run after Close succeeded")
	}
}

// TestRunPurgesAStoreThenProcessTable: the same Purger takes a deferred.Inbox: it refuses one
// without a window, and in the background deletes the consumer's done rows past the window
// while it keeps done rows inside it and pending and dead rows however old.
func TestRunPurgesAStoreThenProcessTable(t *testing.T) {
	sch := testenv.NewSchema(t, 3)
	plain, err := deferred.New(deferred.Config{Pool: sch.Pool, Schema: sch.Name, ConsumerName: "billing"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := retention.New(plain, retention.Config{}, nil); !errors.Is(err, pgstore.ErrNoRetention) {
		t.Fatalf("New on an inbox without a window: %v", err)
	}
	var none *deferred.Inbox
	if _, err := retention.New(none, retention.Config{}, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("New on a nil inbox: %v", err)
	}
	ib, err := deferred.New(deferred.Config{Pool: sch.Pool, Schema: sch.Name, ConsumerName: "billing", Retention: hourly}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ib.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	sch.Exec(t, `INSERT INTO inbox_deferred (message_id, consumer_name, message_uuid, payload, payload_hash, status, done_at, dead_at)
		SELECT 'k' || g, 'billing', 'k' || g, '\x00', '\x00', CASE WHEN g <= 30 THEN 'done' WHEN g <= 35 THEN 'pending' ELSE 'dead' END,
		  CASE WHEN g <= 25 THEN now() - interval '3 hours' WHEN g <= 30 THEN now() END,
		  CASE WHEN g > 35 THEN now() - interval '3 hours' END
		FROM generate_series(1, 40) g`)
	passes := make(chan int64, 100)
	p, err := retention.New(ib, retention.Config{Interval: 50 * time.Millisecond, BatchSize: 10, Pause: time.Millisecond, OnPass: func(r pgstore.PurgeReport, err error) {
		if err != nil {
			t.Errorf("pass: %v", err)
		}
		passes <- r.Rows()
	}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan error, 1)
	go func() { ran <- p.Run(context.Background()) }()
	select {
	case n := <-passes:
		if n != 25 {
			t.Fatalf("first pass deleted %d rows, want 25", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no pass")
	}
	if err := p.Close(); err != nil || <-ran != nil {
		t.Fatal("Close or Run failed")
	}
	var left string
	if err := sch.Pool.QueryRow(context.Background(), "SELECT string_agg(status || '=' || n, ',' ORDER BY status) FROM (SELECT status, count(*) n FROM inbox_deferred GROUP BY status) s").Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != "dead=5,done=5,pending=5" {
		t.Fatalf("rows left: %s", left)
	}
}
