package retention_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
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
		if left == 8 {
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
