package dedup_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/dedup"
)

// newRepo returns a Repository on a fresh schema's inbox table (migrated as the inbox's), and
// a function counting the table's rows of consumer name.
func newRepo(t *testing.T, name string, window time.Duration) (*dedup.Repository, *testenv.Schema) {
	t.Helper()
	sch := testenv.NewSchema(t, 24)
	sch.Store(t) // the inbox table, text layout
	repo, err := dedup.New(dedup.Config{Pool: sch.Pool, Schema: sch.Name, ConsumerName: name, Window: window})
	if err != nil {
		t.Fatal(err)
	}
	return repo, sch
}

func rows(t *testing.T, sch *testenv.Schema, name string) int {
	t.Helper()
	var n int
	if err := sch.Pool.QueryRow(context.Background(),
		"SELECT count(*) FROM inbox_processed_messages WHERE consumer_name = $1", name).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestIsDuplicateWithinTheWindow: a key is new once, a duplicate within the window, new again
// after it (its one row renewed); another consumer name's keys are its own; the state is in
// the table, so a second Repository (another process) sees it. The window is an hour and the
// key's row is moved back past it, rather than a short window slept through: on a loaded
// machine the calls meant to land inside a short window can take longer than it.
func TestIsDuplicateWithinTheWindow(t *testing.T) {
	ctx := context.Background()
	repo, sch := newRepo(t, "dedup-billing", time.Hour)
	for i, want := range []bool{false, true, true} {
		if dup, err := repo.IsDuplicate(ctx, "m-1"); err != nil || dup != want {
			t.Fatalf("call %d: %v, %v; want %v", i+1, dup, err, want)
		}
	}
	other, err := dedup.New(dedup.Config{Pool: sch.Pool, Schema: sch.Name, ConsumerName: "dedup-receipts", Window: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if dup, err := other.IsDuplicate(ctx, "m-1"); err != nil || dup {
		t.Fatalf("another consumer name: %v, %v; want a new key", dup, err)
	}
	again, err := dedup.New(dedup.Config{Pool: sch.Pool, Schema: sch.Name, ConsumerName: "dedup-billing", Window: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if dup, err := again.IsDuplicate(ctx, "m-1"); err != nil || !dup {
		t.Fatalf("a second Repository (a restart): %v, %v; want a duplicate", dup, err)
	}
	// The window passes: the key's record is an hour and a minute old.
	sch.Exec(t, "UPDATE inbox_processed_messages SET received_at = received_at - interval '61 minutes' WHERE consumer_name = 'dedup-billing' AND message_id = 'm-1'")
	if dup, err := repo.IsDuplicate(ctx, "m-1"); err != nil || dup {
		t.Fatalf("after the window: %v, %v; want a new key", dup, err)
	}
	if dup, err := repo.IsDuplicate(ctx, "m-1"); err != nil || !dup {
		t.Fatalf("right after its renewal: %v, %v; want a duplicate", dup, err)
	}
	if n := rows(t, sch, "dedup-billing"); n != 1 {
		t.Fatalf("%d rows for the key, want 1 (renewed in place)", n)
	}
}

// TestConcurrentCopiesOneWins: 20 concurrent checks of one new key on separate connections:
// exactly one is not a duplicate.
func TestConcurrentCopiesOneWins(t *testing.T) {
	repo, sch := newRepo(t, "dedup-race", time.Hour)
	var fresh atomic.Int32
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			dup, err := repo.IsDuplicate(context.Background(), "m-race")
			if err != nil {
				t.Error(err)
			}
			if !dup {
				fresh.Add(1)
			}
		}()
	}
	close(start)
	wg.Wait()
	if fresh.Load() != 1 || rows(t, sch, "dedup-race") != 1 {
		t.Fatalf("%d checks found the key new, %d rows; want 1 and 1", fresh.Load(), rows(t, sch, "dedup-race"))
	}
}

// TestBehindWatermillsDeduplicator: the handler behind the Deduplicator runs once for two
// deliveries of one message (business rows), and — the documented limit — a delivery whose
// handler failed is dropped as a duplicate when it comes back.
func TestBehindWatermillsDeduplicator(t *testing.T) {
	repo, sch := newRepo(t, "dedup-ledger", time.Hour)
	sch.Exec(t, "CREATE TABLE ledger (message_id text PRIMARY KEY)")
	d := &middleware.Deduplicator{
		KeyFactory: func(msg *message.Message) (string, error) { return msg.UUID, nil },
		Repository: repo,
		Timeout:    10 * time.Second, // without it, 5 ms per check: failed on a loaded machine
	}
	fail := errors.New("handler failed")
	h := d.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if msg.UUID == "m-fails" {
			return nil, fail
		}
		_, err := sch.Pool.Exec(msg.Context(), "INSERT INTO ledger VALUES ($1)", msg.UUID)
		return nil, err
	})
	for range 2 {
		if _, err := h(message.NewMessage("m-ok", nil)); err != nil {
			t.Fatal(err)
		}
	}
	var n int
	_ = sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM ledger").Scan(&n)
	if n != 1 {
		t.Fatalf("ledger rows %d, want 1", n)
	}
	if _, err := h(message.NewMessage("m-fails", nil)); !errors.Is(err, fail) {
		t.Fatalf("first delivery: %v", err)
	}
	if _, err := h(message.NewMessage("m-fails", nil)); err != nil {
		t.Fatalf("redelivery after a failure: %v; the Deduplicator drops it (no error), as documented", err)
	}
}

func TestInvalidKeysAndConfig(t *testing.T) {
	repo, _ := newRepo(t, "dedup-keys", time.Hour)
	for _, key := range []string{"", "a\x00b", "\xff", strings.Repeat("k", dedup.MaxKeyBytes+1)} {
		if _, err := repo.IsDuplicate(context.Background(), key); !errors.Is(err, dedup.ErrInvalidKey) {
			t.Errorf("key %q: %v, want dedup.ErrInvalidKey", key, err)
		}
	}
	sch := testenv.NewSchema(t, 2)
	for _, cfg := range []dedup.Config{
		{ConsumerName: "x", Window: time.Hour},
		{Pool: sch.Pool, Window: time.Hour},
		{Pool: sch.Pool, ConsumerName: "x", Window: time.Microsecond},
	} {
		if _, err := dedup.New(cfg); !errors.Is(err, dedup.ErrInvalidConfig) {
			t.Errorf("New(%+v): %v, want dedup.ErrInvalidConfig", cfg, err)
		}
	}
}

// TestDeduplicatorNeedsATimeout: a Deduplicator literal without Timeout gives each check 5 ms
// (Watermill's floor), so a check that waits for a copy's row lock fails with a deadline;
// with the Timeout the package doc sets, the same check waits and finds the duplicate.
func TestDeduplicatorNeedsATimeout(t *testing.T) {
	repo, sch := newRepo(t, "dedup-timeout", time.Hour)
	check := func(timeout time.Duration) error {
		ctx := context.Background()
		tx, err := sch.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO inbox_processed_messages (message_id, consumer_name) VALUES ('m-held', 'dedup-timeout')"); err != nil {
			_ = tx.Rollback(ctx)
			t.Fatal(err)
		}
		// Without a Timeout the copy commits once the check returned (it must not have waited);
		// with one, after 100 ms of the check waiting for the lock (a check that starts later
		// finds the committed row: a duplicate all the same).
		returned := make(chan struct{})
		committed := make(chan error, 1)
		go func() {
			if timeout == 0 {
				<-returned
			} else {
				time.Sleep(100 * time.Millisecond)
			}
			committed <- tx.Commit(ctx)
		}()
		defer func() {
			close(returned)
			if err := <-committed; err != nil {
				t.Errorf("the copy's commit: %v", err)
			}
		}()
		d := &middleware.Deduplicator{
			KeyFactory: func(msg *message.Message) (string, error) { return msg.UUID, nil },
			Repository: repo,
			Timeout:    timeout,
		}
		_, err = d.Middleware(func(*message.Message) ([]*message.Message, error) {
			return nil, errors.New("the handler ran for a duplicate")
		})(message.NewMessage("m-held", nil))
		return err
	}
	if err := check(0); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("without Timeout: %v, want a deadline (Watermill's 5 ms)", err)
	}
	sch.Exec(t, "DELETE FROM inbox_processed_messages WHERE consumer_name = 'dedup-timeout'")
	if err := check(10 * time.Second); err != nil {
		t.Fatalf("with the documented Timeout: %v, want the duplicate dropped", err)
	}
}
