package pgstore_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestPurgeExpiredAndStatsOnEveryLayout: the retention purge and the table statistics work on
// the compact layout (no consumer_name column) and on partitioned tables (a ctid is unique only
// within one partition): expired rows go, every row inside the window stays, per consumer.
func TestPurgeExpiredAndStatsOnEveryLayout(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  pgstore.Config
	}{
		{"Compact", pgstore.Config{Layout: pgstore.LayoutCompact}},
		{"PartitionedFromKey", pgstore.Config{Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}}},
		{"CompactPartitioned", pgstore.Config{Layout: pgstore.LayoutCompact,
			Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			cfg.Retention = hourly
			s, sch := layoutStore(t, 4, cfg)
			ctx := context.Background()
			var old, recent []string
			for i := range 30 {
				id, err := uuid.NewV7()
				if err != nil {
					t.Fatal(err)
				}
				consumer := []string{"billing", "ledger"}[i%2]
				mustCommit(t, s, plain(id.String(), consumer))
				if i < 20 {
					old = append(old, id.String())
				} else {
					recent = append(recent, id.String())
				}
			}
			// Age the first 20 past the 2-hour window (received_at is not the partition key),
			// and two recent ones to 30 seconds inside it: the compact layout's minutes must
			// not purge them early.
			age := func(ids []string, by string) {
				t.Helper()
				set := "received_at = now() - $2::interval"
				if cfg.Layout == pgstore.LayoutCompact {
					set = "received_minute = floor(extract(epoch FROM now() - $2::interval) / 60)::integer"
				}
				if _, err := sch.Pool.Exec(ctx, "UPDATE "+s.Table()+" SET "+set+" WHERE message_id::text = ANY($1)", ids, by); err != nil {
					t.Fatal(err)
				}
			}
			age(old, "3 hours")
			age(recent[:2], "1 hour 59 minutes 30 seconds")
			st, err := s.Stats(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if st.Rows != 30 || st.PerConsumer["billing"] != 15 || st.PerConsumer["ledger"] != 15 {
				t.Fatalf("stats before: rows %d, per consumer %v; want 30, 15 each", st.Rows, st.PerConsumer)
			}
			// Oldest and newest, to the minute in the compact layout.
			if st.Oldest == nil || st.Newest == nil ||
				time.Since(*st.Oldest) < 3*time.Hour-time.Minute || time.Since(*st.Oldest) > 3*time.Hour+2*time.Minute ||
				time.Since(*st.Newest) < -time.Minute || time.Since(*st.Newest) > 2*time.Minute {
				t.Fatalf("stats before: oldest %v, newest %v; want about 3 hours ago and now", st.Oldest, st.Newest)
			}
			rep, err := s.PurgeExpired(ctx, pgstore.PurgeExpiredParams{BatchSize: 3, Pause: -1})
			if err != nil {
				t.Fatal(err)
			}
			var deleted int64
			for _, tb := range rep.Tables {
				deleted += tb.Rows
			}
			if deleted != 20 {
				t.Errorf("purge report %+v: deleted %d, want 20", rep.Tables, deleted)
			}
			left := keys(t, sch, "SELECT message_id::text FROM "+s.Table())
			if len(left) != 10 {
				t.Fatalf("rows left %v, want the 10 recent ones", left)
			}
			want := map[string]bool{}
			for _, k := range recent {
				want[k] = true
			}
			for _, k := range left {
				if !want[k] {
					t.Errorf("row %s inside the window was deleted or an expired one kept", k)
				}
			}
			st, err = s.Stats(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if st.Rows != 10 || st.PerConsumer["billing"]+st.PerConsumer["ledger"] != 10 {
				t.Errorf("stats after: rows %d, per consumer %v; want 10", st.Rows, st.PerConsumer)
			}
		})
	}
}

// TestBatchedInboxOnEveryLayout: group commit's batch claim works on the compact layout and on
// partitioned tables: a batched inbox is built on each, a batch of new messages and copies of
// them applies each message once (balances, inbox rows), and a copy of a message whose key
// was reused with another payload is told apart (a collision, not run).
func TestBatchedInboxOnEveryLayout(t *testing.T) {
	ctx := context.Background()
	for _, cfg := range []pgstore.Config{
		{Layout: pgstore.LayoutCompact},
		{Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}},
		{Layout: pgstore.LayoutCompact, Partitioning: &pgstore.Partitioning{Interval: pgstore.PartitionHourly, ProducerTime: pgstore.ProducerTimeFromKey}},
	} {
		s, sch := layoutStore(t, 10, cfg)
		sch.CreateAccounts(t, 2)
		var collisions atomic.Int64
		ib, err := inbox.New(inbox.Config{Store: s, ConsumerName: "billing", Batch: inbox.BatchConfig{Size: 8, Linger: 300 * time.Millisecond},
			OnKeyCollision: inbox.CollisionSkip, Observer: inbox.ObserverFunc(func(_ context.Context, r inbox.Result) {
				if r.Outcome == inbox.OutcomeCollision {
					collisions.Add(1)
				}
			})}, nil)
		if err != nil {
			t.Fatalf("layout %v, partitioned %v: inbox.New with a batch: %v", cfg.Layout, cfg.Partitioning != nil, err)
		}
		var runs atomic.Int64
		h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			runs.Add(1)
			tx, _ := pgstore.TxFromContext(msg.Context())
			_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + $1 WHERE id = 1", len(msg.Payload))
			return nil, err
		})
		deliver := func(msgs ...*message.Message) {
			t.Helper()
			var wg sync.WaitGroup
			errs := make([]error, len(msgs))
			for k, m := range msgs {
				wg.Go(func() { _, errs[k] = h(m) })
			}
			wg.Wait()
			for k, err := range errs {
				if err != nil {
					t.Fatalf("layout %v, partitioned %v: delivery %d: %v", cfg.Layout, cfg.Partitioning != nil, k, err)
				}
			}
		}
		var ids []string
		var msgs []*message.Message
		for k := range 4 {
			id, err := uuid.NewV7()
			if err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id.String())
			msgs = append(msgs, message.NewMessage(id.String(), make([]byte, 1<<k))) // 1, 2, 4, 8 bytes
		}
		deliver(msgs...)
		// Copies of all four, one with another payload under its key.
		copies := []*message.Message{message.NewMessage(ids[0], make([]byte, 1)), message.NewMessage(ids[1], make([]byte, 2)),
			message.NewMessage(ids[2], make([]byte, 4)), message.NewMessage(ids[3], []byte("another payload"))}
		deliver(copies...)
		var balance int64
		var rows int
		if err := sch.Pool.QueryRow(ctx, "SELECT (SELECT balance FROM accounts WHERE id = 1), (SELECT count(*) FROM "+s.Table()+")").Scan(&balance, &rows); err != nil {
			t.Fatal(err)
		}
		if balance != 15 || rows != 4 || runs.Load() != 4 || collisions.Load() != 1 {
			t.Fatalf("layout %v, partitioned %v: balance %d (want 15), %d inbox rows (want 4), %d runs (want 4), %d collisions (want 1)",
				cfg.Layout, cfg.Partitioning != nil, balance, rows, runs.Load(), collisions.Load())
		}
	}
}

// TestHandlerRunsUnderItsOwnLockTimeout: business statements wait on locks as configured: the
// server's setting without LockTimeout, LockTimeout with it; on every claim path.
func TestHandlerRunsUnderItsOwnLockTimeout(t *testing.T) {
	for _, tc := range []struct {
		name string
		lock time.Duration
		want string
	}{{"server's setting", 0, "0"}, {"LockTimeout", 1500 * time.Millisecond, "1500ms"}} {
		for _, path := range claimPaths {
			t.Run(fmt.Sprintf("%s/%s", tc.name, path.name), func(t *testing.T) {
				s, sch := layoutStore(t, 2, pgstore.Config{LockTimeout: tc.lock})
				ctx := context.Background()
				tx, _ := mustClaim(t, s, path.delivery(plain("m-1", "billing")), contract.Run)
				var got string
				if err := handlerTx(t, tx).QueryRow(ctx, "SELECT current_setting('lock_timeout')").Scan(&got); err != nil {
					t.Fatal(err)
				}
				if got != tc.want {
					t.Errorf("the handler's lock_timeout is %q, want %q", got, tc.want)
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				if n := count(t, sch, "SELECT count(*) FROM "+s.Table()); n != 1 {
					t.Errorf("inbox rows %d, want 1", n)
				}
			})
		}
	}
}
