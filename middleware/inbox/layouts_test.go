package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestPoisonWithTheDeadLetterTopicDown: on every layout, immediate and batched (the
// poison message delivered beside three healthy ones, so it meets them in a batch), a message
// whose handler always fails, MaxAttempts 3, counting first (no redelivery signal), while the
// dead-letter topic is down: the handler runs exactly 3 times whatever the number of
// redeliveries, the record never holds more than 3 attempts (CountLimit), the healthy
// messages are applied once each; once the topic is back, one dead letter, the record
// dead-lettered with 3 attempts, and no live attempt record left.
func TestPoisonWithTheDeadLetterTopicDown(t *testing.T) {
	const maxAttempts, rounds = 3, 8
	for _, batched := range []bool{false, true} {
		forEachLayout(t, func(t *testing.T, l storeLayout) {
			t.Run(fmt.Sprintf("batched=%v", batched), func(t *testing.T) {
				e := newLayoutEnv(t, 10, l)
				dl := newDeadLetters(t)
				dl.down.Store(true)
				ib := e.inbox("billing", withDeadLetters(dl, maxAttempts), func(c *inbox.Config) {
					if batched {
						c.Batch = inbox.BatchConfig{Size: 4, Linger: 50 * time.Millisecond}
					}
				})
				var poisonRuns atomic.Int64
				h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					if msg.UUID == "poi" {
						poisonRuns.Add(1)
						return nil, errors.New("poison")
					}
					return e.credit(msg)
				})
				maxSeen := 0
				check := func() {
					var n int
					err := e.sch.Pool.QueryRow(context.Background(), "SELECT coalesce(max(attempts), 0) FROM "+e.store.AttemptsTable()).Scan(&n)
					if err != nil {
						t.Fatal(err)
					}
					maxSeen = max(maxSeen, n)
				}
				for round := range rounds {
					var wg sync.WaitGroup
					wg.Go(func() { _ = deliver(h, paymentMsg("poi", 1, 1000)) })
					for k := range 3 {
						m := paymentMsg(fmt.Sprintf("h%d-%d", round, k), 2, 10)
						wg.Go(func() { redeliverUntilAcked(t, h, m, 20) })
					}
					wg.Wait()
					check()
				}
				if n := poisonRuns.Load(); n != maxAttempts {
					t.Errorf("the poison handler ran %d times over %d deliveries, want %d", n, rounds, maxAttempts)
				}
				if maxSeen > maxAttempts {
					t.Errorf("an attempt record held %d attempts, more than MaxAttempts %d", maxSeen, maxAttempts)
				}
				dl.down.Store(false)
				if err := deliver(h, paymentMsg("poi", 1, 1000)); err != nil {
					t.Fatalf("delivery after the dead-letter topic came back: %v", err)
				}
				dl.wait(t, 1)
				var attempts, live int
				var dead bool
				if err := e.sch.Pool.QueryRow(context.Background(), "SELECT attempts, dead_lettered_at IS NOT NULL, (SELECT count(*) FROM "+e.store.AttemptsTable()+" WHERE dead_lettered_at IS NULL) FROM "+e.store.AttemptsTable()+" WHERE message_id = $1", e.key("poi")).Scan(&attempts, &dead, &live); err != nil {
					t.Fatal(err)
				}
				if attempts != maxAttempts || !dead || live != 0 {
					t.Errorf("poison record: %d attempts, dead-lettered %v, %d live records; want %d, true, 0", attempts, dead, live, maxAttempts)
				}
				if b := e.balance(2); b != 10*3*rounds {
					t.Errorf("healthy balance %d, want %d", b, 10*3*rounds)
				}
				if b := e.balance(1); b != 0 {
					t.Errorf("poison balance %d, want 0", b)
				}
				if n := poisonRuns.Load(); n != maxAttempts {
					t.Errorf("the poison handler ran %d times in all, want %d", n, maxAttempts)
				}
			})
		})
	}
}

// TestFloodOfCopiesOnEveryLayout: on every layout, immediate and batched, at each
// isolation level, 12 copies of
// one healthy message at once (half flagged as redeliveries), with dead letters on
// (MaxAttempts 2) and the default claim lock timeout: each message is applied exactly once,
// nothing is dead-lettered, and the attempts table is empty at the end.
func TestFloodOfCopiesOnEveryLayout(t *testing.T) {
	const copies, rounds = 12, 8
	for _, batched := range []bool{false, true} {
		forEachLayout(t, func(t *testing.T, l storeLayout) {
			for _, iso := range []sql.IsolationLevel{sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable} {
				t.Run(fmt.Sprintf("batched=%v/%s", batched, iso), func(t *testing.T) {
					e := newLayoutEnv(t, 8, l)
					dl := newDeadLetters(t)
					ib := e.inbox("billing", withDeadLetters(dl, 2), func(c *inbox.Config) {
						c.Redelivery = redeliveryFromFlag
						c.Isolation = iso
						if batched {
							c.Batch = inbox.BatchConfig{Size: 4, Linger: 5 * time.Millisecond}
						}
					})
					h := ib.Middleware(e.credit)
					for round := range rounds {
						msg := paymentMsg(fmt.Sprintf("f%d", round), 2, 10)
						var wg sync.WaitGroup
						for c := range copies {
							m := msg.Copy()
							if c%2 == 1 {
								m.Metadata.Set(redeliveredKey, "true")
							}
							wg.Go(func() { redeliverUntilAcked(t, h, m, 100) })
						}
						wg.Wait()
					}
					if b := e.balance(2); b != 10*rounds {
						t.Errorf("balance %d, want %d (each message applied once)", b, 10*rounds)
					}
					if s := ib.Stats(); s.DeadLettered != 0 {
						t.Errorf("healthy messages dead-lettered: %+v", s)
					}
					var records int
					if err := e.sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+e.store.AttemptsTable()).Scan(&records); err != nil || records != 0 {
						t.Errorf("%d attempt records left (%v), want 0", records, err)
					}
				})
			}
		})
	}
}

// TestBatchMateWithoutAPartitionDoesNotNackTheOthers: partitioned inbox table, batched
// mode, no retention guard: a delivery whose UUIDv7 is five days old (no partition for its
// period) arrives with three healthy deliveries and shares their batch. The healthy ones are
// applied and acked on their first delivery, as in the immediate mode; only the one without
// a partition fails (ErrNoPartition).
func TestBatchMateWithoutAPartitionDoesNotNackTheOthers(t *testing.T) {
	e := newEnv(t, 8)
	s, err := pgstore.New(e.sch.Pool, pgstore.Config{Schema: e.sch.Name, Table: "part_inbox", Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	e.store = s
	ib := e.inbox("billing", func(c *inbox.Config) {
		c.Batch = inbox.BatchConfig{Size: 4, Linger: 200 * time.Millisecond}
	})
	h := ib.Middleware(e.credit)
	old := paymentMsg(uuidV7At(time.Now().Add(-5*24*time.Hour)), 1, 1000)
	var healthy []*message.Message
	for range 3 {
		healthy = append(healthy, paymentMsg(uuidV7At(time.Now()), 2, 10))
	}
	var wg sync.WaitGroup
	var oldErr error
	errs := make([]error, len(healthy))
	wg.Go(func() { oldErr = deliver(h, old) })
	for k, m := range healthy {
		wg.Go(func() { errs[k] = deliver(h, m) })
	}
	wg.Wait()
	if !errors.Is(oldErr, pgstore.ErrNoPartition) {
		t.Errorf("the delivery without a partition: %v, want ErrNoPartition", oldErr)
	}
	for k, err := range errs {
		if err != nil {
			t.Errorf("healthy delivery %d was nacked because of a batch mate: %v", k, err)
		}
	}
	if b := e.balance(2); b != 30 {
		t.Errorf("healthy balance %d, want 30", b)
	}
}
