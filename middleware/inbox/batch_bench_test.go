package inbox_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// BenchmarkBatched measures messages per second through a Watermill router on GoChannel at 32
// concurrent deliveries (32 subscribers, each acked before its publisher sends the next
// message), for: a bare transaction per message (BEGIN, the handler's UPDATE, COMMIT; no
// claim), the immediate inbox, and the batched inbox (Config.Batch) in both designs,
// optimistic and savepoints, at batch size size (Linger 2 ms). The modes run interleaved in
// chunks within one benchmark, one chunk per mode in an order that rotates (every mode runs
// once in every position), so their ratios are measured under the same machine load.
// Metrics: each mode's msg/s, and batched/immediate and batched/bare ratios. The dlq variants
// add a dead-letter topic on a broker without a first-delivery signal (every delivery counted
// durably before its handler: the costliest accounting, as on Kafka).
//
//	go test ./middleware/inbox -run '^$' -bench Batched -benchtime 4000x -count 3
func BenchmarkBatched(b *testing.B) {
	for _, size := range []int{8, 16} {
		b.Run(fmt.Sprintf("deliveries=32/size=%d", size), func(b *testing.B) { benchBatched(b, 32, size) })
	}
}

func benchBatched(b *testing.B, slots, size int) {
	const accounts = 10000
	sch := testenv.NewSchema(b, 10)
	ctx := context.Background()
	store := sch.Store(b)
	sch.CreateAccounts(b, accounts)
	dlq := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	newInbox := func(name string, batch inbox.BatchConfig, dead bool) *inbox.Inbox {
		cfg := inbox.Config{Store: store, ConsumerName: name, Batch: batch}
		if dead {
			cfg.DeadLetterPublisher, cfg.DeadLetterTopic = dlq, "dead"
		}
		ib, err := inbox.New(cfg, nil)
		if err != nil {
			b.Fatal(err)
		}
		return ib
	}
	modes := []struct {
		name string
		ib   *inbox.Inbox
	}{
		{"bare", nil},
		{"immediate", newInbox("immediate", inbox.BatchConfig{}, false)},
		{"optimistic", newInbox("optimistic", inbox.BatchConfig{Size: size}, false)},
		{"savepoints", newInbox("savepoints", inbox.BatchConfig{Size: size, Mode: inbox.BatchSavepoints}, false)},
		{"immediate-dlq", newInbox("immediate-dlq", inbox.BatchConfig{}, true)},
		{"optimistic-dlq", newInbox("optimistic-dlq", inbox.BatchConfig{Size: size}, true)},
	}
	handler := func(msg *message.Message) error {
		tx, ok := msg.Context().Value(bareTxKey{}).(pgx.Tx)
		if !ok {
			tx, _ = pgstore.TxFromContext(msg.Context())
		}
		_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 1 WHERE id = $1", rand.IntN(accounts)+1)
		return err
	}
	bare := func(msg *message.Message) error {
		tx, err := sch.Pool.BeginTx(msg.Context(), pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
		if err != nil {
			return err
		}
		return inTx(msg, tx, handler)
	}

	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		b.Fatal(err)
	}
	for _, m := range modes {
		h := bare
		if m.ib != nil {
			wrapped := m.ib.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, handler(msg) })
			h = func(msg *message.Message) error { _, err := wrapped(msg); return err }
		}
		for s := range slots {
			name := fmt.Sprintf("%s-%d", m.name, s)
			router.AddConsumerHandler(name, name, pubsub, h)
		}
	}
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	b.Cleanup(func() { _ = router.Close(); _ = pubsub.Close() })

	run := func(prefix string, n int) time.Duration {
		start := time.Now()
		var wg sync.WaitGroup
		for s := range slots {
			share := n / slots
			if s < n%slots {
				share++
			}
			wg.Go(func() {
				for range share {
					if err := pubsub.Publish(fmt.Sprintf("%s-%d", prefix, s), message.NewMessage(uuid.NewString(), nil)); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		return time.Since(start)
	}
	for _, m := range modes {
		run(m.name, 4*slots) // warm: connections, prepared statements
	}
	b.ResetTimer()
	took := make([]time.Duration, len(modes))
	// One chunk per mode, the order rotated by one each chunk, so every mode runs once in
	// every position (the mode right after bare runs slower: see BenchmarkInboxVsBareTx).
	chunks := len(modes)
	for c := range chunks {
		n := b.N / chunks
		if c < b.N%chunks {
			n++
		}
		for k := range modes {
			mi := (k + c) % len(modes)
			took[mi] += run(modes[mi].name, n)
		}
	}
	b.StopTimer()
	rate := map[string]float64{}
	for k, m := range modes {
		rate[m.name] = float64(b.N) / took[k].Seconds()
		b.ReportMetric(rate[m.name], m.name+"-msg/s")
		if m.ib != nil {
			if st := m.ib.Stats(); st.Processed < uint64(b.N) || st.Failed != 0 {
				b.Fatalf("%s: stats %+v after %d messages", m.name, st, b.N+4*slots)
			}
		}
	}
	b.ReportMetric(rate["optimistic"]/rate["immediate"], "optimistic/immediate")
	b.ReportMetric(rate["savepoints"]/rate["immediate"], "savepoints/immediate")
	b.ReportMetric(rate["optimistic"]/rate["bare"], "optimistic/bare")
	b.ReportMetric(rate["optimistic-dlq"]/rate["immediate-dlq"], "optimistic-dlq/immediate-dlq")
	b.ReportMetric(0, "ns/op")
}
