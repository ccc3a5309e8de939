package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// creditArgs is the River job of one received message: unique by the message ID (the
// river:"unique" tag with UniqueOpts.ByArgs), so a redelivered message inserts no second job.
type creditArgs struct {
	MessageID string `json:"message_id" river:"unique"`
	Account   int    `json:"account"`
}

func (creditArgs) Kind() string { return "credit" }

// creditWorker applies the credit and completes the job in one transaction
// (river.JobCompleteTx), so the UPDATE is applied exactly once, as the inbox applies it.
type creditWorker struct {
	river.WorkerDefaults[creditArgs]
	pool *pgxpool.Pool
	done *atomic.Uint64
}

func (w *creditWorker) Work(ctx context.Context, job *river.Job[creditArgs]) error {
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + 1 WHERE id = $1", job.Args.Account); err != nil {
		return err
	}
	if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	w.done.Add(1)
	return nil
}

// BenchmarkStoreThenProcess measures store-then-process consumers end to end on GoChannel:
// each received message is stored (and acked once stored), and the work, the same UPDATE on one
// of 10,000 account rows as in BenchmarkPeers, runs later; the clock runs from the first
// publish until every message's work committed. Rows:
//
//   - river: River (github.com/riverqueue/river v0.51.2, riverpgxv5) as the peer: the handler
//     inserts a job unique by the message ID (river.Client.Insert with UniqueOpts.ByArgs) and
//     acks; River's workers (Queues MaxWorkers = the number of concurrent deliveries,
//     FetchCooldown 1 ms, as a user tuning for throughput would set it) run the UPDATE and
//     river.JobCompleteTx in one transaction.
//
//   - inbox: the immediate inbox doing the UPDATE on receipt, as the reference, interleaved
//     with river in four chunks.
//
// It reports river-msg/s, inbox-msg/s and river/inbox at each -deliveries count, sharing
// BenchmarkPeers' -pool (River's own connections, its LISTEN connection and fetches
// included). b.N is the number of messages per row.
//
//	cd tests/bench && go test . -run '^$' -bench StoreThenProcess -benchtime 2000x -count 3
func BenchmarkStoreThenProcess(b *testing.B) {
	for _, n := range deliveryCounts(b) {
		b.Run(fmt.Sprintf("deliveries=%d", n), func(b *testing.B) { benchStoreThenProcess(b, n) })
	}
}

func benchStoreThenProcess(b *testing.B, slots int) {
	const accounts = 10000
	ctx := context.Background()
	sch := testenv.NewSchema(b, int32(*poolFlag))
	sch.CreateAccounts(b, accounts)
	migrator, err := rivermigrate.New(riverpgxv5.New(sch.Pool), &rivermigrate.Config{Schema: sch.Name})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		b.Fatal(err)
	}
	done := new(atomic.Uint64)
	workers := river.NewWorkers()
	river.AddWorker(workers, &creditWorker{pool: sch.Pool, done: done})
	client, err := river.NewClient(riverpgxv5.New(sch.Pool), &river.Config{
		Schema:        sch.Name,
		Queues:        map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: slots}},
		Workers:       workers,
		FetchCooldown: river.FetchCooldownMin,
		Logger:        nil,
	})
	if err != nil {
		b.Fatal(err)
	}
	if err := client.Start(ctx); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		_ = client.Stop(sctx)
	})

	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		b.Fatal(err)
	}
	var inserted atomic.Uint64
	for s := range slots {
		topic := fmt.Sprintf("river-%d", s)
		router.AddConsumerHandler(topic, topic, pubsub, func(msg *message.Message) error {
			res, err := client.Insert(msg.Context(), creditArgs{MessageID: msg.UUID, Account: rand.IntN(accounts) + 1},
				&river.InsertOpts{UniqueOpts: river.UniqueOpts{ByArgs: true}})
			if err != nil {
				return err
			}
			if !res.UniqueSkippedAsDuplicate {
				inserted.Add(1)
			}
			return nil
		})
	}
	ib, err := inbox.New(inbox.Config{Store: sch.Store(b), ConsumerName: "reference"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	processOnReceipt := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := pgstore.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 1 WHERE id = $1", rand.IntN(accounts)+1)
		return nil, err
	})
	for s := range slots {
		topic := fmt.Sprintf("inbox-%d", s)
		router.AddConsumerHandler(topic, topic, pubsub, func(msg *message.Message) error {
			_, err := processOnReceipt(msg)
			return err
		})
	}
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	b.Cleanup(func() { _ = router.Close(); _ = pubsub.Close() })

	// STORE-THEN-PROCESS (package middleware/deferred): its row goes here, run in the same
	// iteration and interleaved with River's the way BenchmarkPeers interleaves its modes,
	// reporting stp-msg/s; its work must be counted when it committed, not when stored.

	wait := func(n uint64) {
		deadline := time.Now().Add(2 * time.Minute)
		for done.Load() < n {
			if time.Now().After(deadline) {
				b.Fatalf("river: %d of %d jobs worked after 2 minutes", done.Load(), n)
			}
			time.Sleep(time.Millisecond)
		}
	}
	warm := 2 * slots
	publishSlots(b, pubsub, "river", slots, warm) // warm up: connections, statements, workers
	wait(uint64(warm))
	publishSlots(b, pubsub, "inbox", slots, warm)
	b.ResetTimer()
	// Interleaved in four chunks with the immediate inbox (the same UPDATE, processed on
	// receipt), so river/inbox is measured under the same machine load.
	var riverT, inboxT time.Duration
	const chunks = 4
	for c := range chunks {
		n := b.N / chunks
		if c < b.N%chunks {
			n++
		}
		start := time.Now()
		base := done.Load()
		publishSlots(b, pubsub, "river", slots, n)
		wait(base + uint64(n))
		riverT += time.Since(start)
		inboxT += publishSlots(b, pubsub, "inbox", slots, n)
	}
	b.StopTimer()
	riverRate, inboxRate := float64(b.N)/riverT.Seconds(), float64(b.N)/inboxT.Seconds()
	b.ReportMetric(riverRate, "river-msg/s")
	b.ReportMetric(inboxRate, "inbox-msg/s")
	b.ReportMetric(riverRate/inboxRate, "river/inbox")
	b.ReportMetric(0, "ns/op")
	if got := ib.Stats().Processed; got != uint64(warm+b.N) {
		b.Fatalf("inbox processed %d, want %d", got, warm+b.N)
	}

	// Business state: one job per message, each applied once, and the inbox's UPDATEs.
	var sum int64
	if err := sch.Pool.QueryRow(ctx, "SELECT coalesce(sum(balance), 0) FROM accounts").Scan(&sum); err != nil {
		b.Fatal(err)
	}
	if want := uint64(warm + b.N); uint64(sum) != 2*want || inserted.Load() != want {
		b.Fatalf("balances sum to %d, %d jobs inserted; want %d and %d", sum, inserted.Load(), 2*want, want)
	}
}
