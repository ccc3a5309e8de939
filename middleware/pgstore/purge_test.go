package pgstore_test

import (
	"context"
	"errors"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// hourly is a retention of 2 hours (1 hour of declared redelivery + 1 hour of margin) and a
// dead-letter window of 1 day: tests age rows by hours instead of waiting.
var hourly = inbox.Retention{Window: 2 * time.Hour, MaxRedelivery: time.Hour, Margin: time.Hour, DeadLetterWindow: 24 * time.Hour}

func retentionStore(t *testing.T, sch *testenv.Schema, r inbox.Retention) *pgstore.Store {
	t.Helper()
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Retention: r})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if _, err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return s
}

func keys(t *testing.T, sch *testenv.Schema, q string) []string {
	t.Helper()
	rows, err := sch.Pool.Query(context.Background(), q)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			t.Fatal(err)
		}
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func count(t *testing.T, sch *testenv.Schema, q string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := sch.Pool.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestRetentionWindowIsValidated(t *testing.T) {
	sch := testenv.NewSchema(t, 1)
	for _, r := range []inbox.Retention{
		{Window: time.Hour}, // default MaxRedelivery 7 days
		{Window: 2 * time.Hour, MaxRedelivery: 2 * time.Hour}, // + the default 1-day margin
		{Window: 3 * time.Hour, MaxRedelivery: time.Hour, Margin: 3 * time.Hour},
		{Window: 2 * time.Hour, MaxRedelivery: time.Hour, Margin: time.Hour, DeadLetterWindow: time.Hour},
		{Window: -time.Hour},
	} {
		_, err := pgstore.New(sch.Pool, pgstore.Config{Retention: r})
		var re *inbox.RetentionError
		if !errors.As(err, &re) || !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("New with retention %+v: %v, want an *inbox.RetentionError", r, err)
		}
	}
	s, err := pgstore.New(sch.Pool, pgstore.Config{Retention: hourly})
	if err != nil {
		t.Fatal(err)
	}
	if r, ok := s.Retention(); !ok || r != hourly {
		t.Fatalf("Retention() = %+v, %v", r, ok)
	}
	plain, _ := pgstore.New(sch.Pool, pgstore.Config{})
	if _, err := plain.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{}); !errors.Is(err, pgstore.ErrNoRetention) {
		t.Fatalf("PurgeExpired without a window: %v, want ErrNoRetention", err)
	}
}

// TestPurgeNeverDeletesInsideTheWindow ages rows of every kind around their cutoffs and
// checks, row by row, what a purge in batches of 2 deletes: processed rows and live attempt
// records past the window, dead-lettered records past the dead-letter window, watermill-sql
// rows consumed by every group and past the window; never a row inside a window, never the
// record of a key a delivery holds, never a row a consumer group has not consumed. A dry run
// first reports the same numbers and changes nothing.
func TestPurgeNeverDeletesInsideTheWindow(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	s := retentionStore(t, sch, hourly)
	ctx := context.Background()
	// Processed rows: ages in minutes; the window is 120.
	for k, age := range map[string]int{"p-old-1": 600, "p-old-2": 121, "p-old-3": 125, "p-old-4": 180, "p-edge": 119, "p-in": 60, "p-new": 0} {
		sch.Exec(t, "INSERT INTO inbox_processed_messages (message_id, consumer_name, received_at) VALUES ($1, 'c', now() - make_interval(mins => $2))", k, age)
	}
	// Attempt records: live ones age by last_attempt_at, dead-lettered ones by dead_lettered_at (window 1 day).
	for k, age := range map[string]int{"a-old": 200, "a-held": 200, "a-in": 100} {
		sch.Exec(t, "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, last_attempt_at) VALUES ($1, 'c', now() - make_interval(mins => $2))", k, age)
	}
	for k, age := range map[string]int{"d-old": 25 * 60, "d-in": 23 * 60, "d-past-window": 200} {
		sch.Exec(t, "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, last_attempt_at, dead_lettered_at, dead_letter_reason) VALUES ($1, 'c', now() - interval '30 days', now() - make_interval(mins => $2), 'r')", k, age)
	}
	// A delivery of "a-held" is in flight: it holds the key's advisory lock (pgstore's lockKey).
	holder, err := sch.Pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	held := true
	t.Cleanup(func() { // on a failure, before the pool closes
		if held {
			holder.Release()
		}
	})
	lockKey := s.Table() + "\x1f" + "c" + "\x1f" + "a-held"
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_lock(hashtextextended($1, 0))", lockKey); err != nil {
		t.Fatal(err)
	}
	// Two watermill-sql topics: "orders" with two groups at different positions; "lonely" with
	// no group at all.
	for _, topic := range []string{"orders", "lonely"} {
		if err := outbox.InitializeSchema(ctx, sch.Pool, outbox.Config{Schema: sch.Name, Topic: topic}); err != nil {
			t.Fatal(err)
		}
		// Ten rows in ten transactions (txid 1001..1010); rows 9 and 10 are recent.
		sch.Exec(t, `INSERT INTO watermill_`+topic+` ("offset", uuid, created_at, payload, transaction_id)
			SELECT g, 'm' || g, CASE WHEN g > 8 THEN CURRENT_TIMESTAMP::timestamp ELSE (CURRENT_TIMESTAMP - interval '3 hours')::timestamp END,
			'{}', (1000 + g)::text::xid8 FROM generate_series(1, 10) g`)
	}
	sch.Exec(t, `INSERT INTO watermill_offsets_orders (consumer_group, offset_acked, last_processed_transaction_id) VALUES ('fast', 10, '1010'), ('slow', 5, '1005')`)

	topics := []pgstore.WatermillTopic{{Schema: sch.Name, Topic: "orders"}, {Topic: "lonely"}}
	dry, err := s.PurgeExpired(ctx, pgstore.PurgeExpiredParams{DryRun: true, Topics: topics})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{"inbox": 4, "attempts": 2, "dead_letters": 1, "topic:orders": 5, "topic:lonely": 0}
	got := func(rep pgstore.PurgeReport) map[string]int64 {
		m := map[string]int64{}
		for _, tb := range rep.Tables {
			name := tb.Kind
			if tb.Kind == pgstore.PurgeKindTopic {
				name = "topic:lonely"
				if strings.Contains(tb.Table, "orders") {
					name = "topic:orders"
				}
			}
			m[name] = tb.Rows
		}
		return m
	}
	// The dry run counts the held record among the expired (it cannot know a lock); the
	// real purge skips it.
	if g := got(dry); !equal(g, want) || !dry.DryRun {
		t.Fatalf("dry run = %v, want %v", g, want)
	}
	if n := count(t, sch, "SELECT count(*) FROM inbox_processed_messages") + count(t, sch, "SELECT count(*) FROM inbox_processed_messages_attempts") + count(t, sch, "SELECT count(*) FROM watermill_orders"); n != 7+6+10 {
		t.Fatalf("the dry run changed rows: %d left, want 23", n)
	}

	rep, err := s.PurgeExpired(ctx, pgstore.PurgeExpiredParams{BatchSize: 2, Pause: -1, Topics: topics})
	if err != nil {
		t.Fatal(err)
	}
	want["attempts"] = 1 // a-held is in flight
	if g := got(rep); !equal(g, want) {
		t.Fatalf("purge = %v, want %v", g, want)
	}
	if rep.Tables[0].Batches != 3 { // 2 + 2 + 0 rows
		t.Fatalf("inbox purge ran %d batches, want 3 (batches of 2, until one is short)", rep.Tables[0].Batches)
	}
	if g := keys(t, sch, "SELECT message_id FROM inbox_processed_messages"); !equalS(g, []string{"p-edge", "p-in", "p-new"}) {
		t.Fatalf("processed rows left: %v", g)
	}
	if g := keys(t, sch, "SELECT message_id FROM inbox_processed_messages_attempts"); !equalS(g, []string{"a-held", "a-in", "d-in", "d-past-window"}) {
		t.Fatalf("attempt records left: %v", g)
	}
	if g := keys(t, sch, "SELECT uuid FROM watermill_orders"); !equalS(g, []string{"m10", "m6", "m7", "m8", "m9"}) {
		t.Fatalf("orders rows left: %v (rows 1-5 are below both groups' offsets and old)", g)
	}
	if n := count(t, sch, "SELECT count(*) FROM watermill_lonely"); n != 10 {
		t.Fatalf("a topic without consumer groups lost rows: %d left", n)
	}
	// The delivery ends; the next pass removes its record.
	if _, err := holder.Exec(ctx, "SELECT pg_advisory_unlock(hashtextextended($1, 0))", lockKey); err != nil {
		t.Fatal(err)
	}
	holder.Release()
	held = false
	if _, err := s.PurgeExpired(ctx, pgstore.PurgeExpiredParams{Pause: -1}); err != nil {
		t.Fatal(err)
	}
	if g := keys(t, sch, "SELECT message_id FROM inbox_processed_messages_attempts"); !equalS(g, []string{"a-in", "d-in", "d-past-window"}) {
		t.Fatalf("attempt records left after the delivery ended: %v", g)
	}
}

// TestTwoPurgersAtOnce: two stores on two pools purge one table at the same time, again and
// again: exactly one runs at a time (the other gets ErrPurgeInProgress), nothing is deleted
// twice (the rows reported add up to the rows that existed), no deadlock, nothing left.
func TestTwoPurgersAtOnce(t *testing.T) {
	sch := testenv.NewSchema(t, 3)
	s1 := retentionStore(t, sch, hourly)
	pool2 := testenv.NewPool(t, sch.URL, 3)
	s2, err := pgstore.New(pool2, pgstore.Config{Schema: sch.Name, Retention: hourly})
	if err != nil {
		t.Fatal(err)
	}
	const expired = 12000
	sch.Exec(t, "INSERT INTO inbox_processed_messages (message_id, consumer_name, received_at) SELECT 'k' || g, 'c', now() - interval '3 hours' FROM generate_series(1, $1::int) g", expired)
	sch.Exec(t, "INSERT INTO inbox_processed_messages (message_id, consumer_name) SELECT 'fresh' || g, 'c' FROM generate_series(1, 100) g")
	var deleted, busy atomic.Int64
	var wg sync.WaitGroup
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, s := range []*pgstore.Store{s1, s2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 20; i++ {
				rep, err := s.PurgeExpired(ctx, pgstore.PurgeExpiredParams{BatchSize: 500, Pause: 5 * time.Millisecond})
				switch {
				case errors.Is(err, pgstore.ErrPurgeInProgress):
					busy.Add(1)
				case err != nil:
					t.Errorf("purge: %v", err)
					return
				default:
					deleted.Add(rep.Rows())
				}
				time.Sleep(time.Millisecond)
			}
		}()
	}
	wg.Wait()
	if deleted.Load() != expired {
		t.Fatalf("purgers reported %d rows deleted, want %d (each row once)", deleted.Load(), expired)
	}
	if busy.Load() == 0 {
		t.Fatal("the two purgers never met: no ErrPurgeInProgress")
	}
	if n := count(t, sch, "SELECT count(*) FROM inbox_processed_messages"); n != 100 {
		t.Fatalf("%d rows left, want the 100 fresh ones", n)
	}
}

// TestClaimsSucceedDuringPurge: four workers claim and commit new keys without a pause while a
// purge deletes 30,000 expired rows in batches of 1,000; every claim succeeds, each is in the
// table afterwards, and claims did run while the purge ran.
func TestClaimsSucceedDuringPurge(t *testing.T) {
	sch := testenv.NewSchema(t, 6)
	s := retentionStore(t, sch, hourly)
	sch.Exec(t, "INSERT INTO inbox_processed_messages (message_id, consumer_name, received_at) SELECT 'old' || g, 'c', now() - interval '3 hours' FROM generate_series(1, 30000) g")
	sch.Exec(t, "VACUUM ANALYZE inbox_processed_messages")
	ctx := context.Background()
	var purging atomic.Bool
	purging.Store(true)
	var during, total atomic.Int64
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				tx, res, err := s.Claim(ctx, plain("new-"+strconv.Itoa(w)+"-"+strconv.Itoa(i), "c"))
				if err != nil || res.Decision != contract.Run {
					t.Errorf("claim during purge: %+v, %v", res, err)
					return
				}
				if err := tx.Commit(ctx); err != nil {
					t.Errorf("commit during purge: %v", err)
					return
				}
				total.Add(1)
				if purging.Load() {
					during.Add(1)
				}
			}
		}()
	}
	rep, err := s.PurgeExpired(ctx, pgstore.PurgeExpiredParams{BatchSize: 1000, Pause: -1})
	purging.Store(false)
	close(stop)
	wg.Wait()
	if err != nil || rep.Tables[0].Rows != 30000 {
		t.Fatalf("purge: %+v, %v", rep.Tables, err)
	}
	if during.Load() == 0 {
		t.Fatal("no claim ran during the purge")
	}
	if n := count(t, sch, "SELECT count(*) FROM inbox_processed_messages WHERE message_id LIKE 'new-%'"); n != total.Load() {
		t.Fatalf("%d claimed rows in the table, %d claims committed", n, total.Load())
	}
	if n := count(t, sch, "SELECT count(*) FROM inbox_processed_messages WHERE message_id LIKE 'old%'"); n != 0 {
		t.Fatalf("%d expired rows left", n)
	}
	t.Logf("%d claims committed, %d during the purge (%d batches)", total.Load(), during.Load(), rep.Tables[0].Batches)
}

func equal(a, b map[string]int64) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func equalS(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
