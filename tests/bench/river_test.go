package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
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
	pool  *pgxpool.Pool
	done  *atomic.Uint64
	clock *e2eClock
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
	w.clock.committed("river", job.Args.MessageID)
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
//   - deferred: the store-then-process inbox (package middleware/deferred) configured as its
//     package example does: deferred.Inbox.Receive as the router's handler, and
//     Inbox.NewConsumerWorkers running the UPDATE in each row's transaction, with Workers = the
//     number of concurrent deliveries (as River's MaxWorkers) and every other field at its
//     default (BatchSize 50, LISTEN/NOTIFY wake-ups, PollInterval 1 s). A message counts once
//     its row's commit returned (Counters.Done). It has a pool of its own, of the same -pool
//     size, whose tracer timestamps the commits (below).
//
//   - inbox: the immediate inbox doing the UPDATE on receipt, as the reference.
//
// The three run in the same iteration, interleaved in one chunk per row whose order rotates
// (every row runs once in every position), so their ratios are measured under the same machine
// load. It reports river-msg/s, deferred-msg/s, inbox-msg/s, river/inbox, deferred/inbox and
// ratio-deferred-river (deferred msg/s over River msg/s) at each -deliveries count, and the
// end-to-end latency of river and deferred at p50 and p99 in milliseconds
// (river-e2e-p50-ms...): from just before the message's Publish to the return of the commit
// of its work (River: tx.Commit in the worker; deferred: the end of the round trip that sends
// the row's done-mark and COMMIT, seen by a pgx BatchTracer on its connection). The publishers
// wait only for the receipt's ack, so stored messages not yet worked can pile up: the
// latency includes that backlog's wait. River and the immediate inbox share BenchmarkPeers'
// -pool (River's own connections, its LISTEN connection and fetches included). b.N is the
// number of messages per row.
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
	clock := &e2eClock{ms: map[string][]float64{}}
	work := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + 1 WHERE id = $1", rand.IntN(accounts)+1)
		return err
	}
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		b.Fatal(err)
	}
	worked, inserted := startRiver(b, sch, router, pubsub, slots, accounts, clock)
	dib := startDeferred(b, sch, router, pubsub, slots, clock, work)
	ib, err := inbox.New(inbox.Config{Store: sch.Store(b), ConsumerName: "reference"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	processOnReceipt := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := pgstore.TxFromContext(msg.Context())
		return nil, work(msg.Context(), tx)
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

	// A row's run publishes n messages and returns the time until the last one's work
	// committed; the deferred and River rows time each message (clock).
	afterWork := func(name string, committed func() uint64) func(n int, sent *sync.Map) time.Duration {
		return func(n int, sent *sync.Map) time.Duration {
			start := time.Now()
			base := committed()
			publishSlotsTimed(b, pubsub, name, slots, n, sent)
			waitCommitted(b, name, committed, base+uint64(n))
			return time.Since(start)
		}
	}
	rows := []struct {
		name string
		run  func(n int, sent *sync.Map) time.Duration
	}{
		{"river", afterWork("river", worked.Load)},
		{"deferred", afterWork("deferred", func() uint64 { return dib.Counters().Done })},
		{"inbox", func(n int, _ *sync.Map) time.Duration { return publishSlots(b, pubsub, "inbox", slots, n) }},
	}
	warm := 2 * slots
	for _, r := range rows {
		r.run(warm, nil) // warm up: connections, statements, workers; not timed per message
	}
	b.ResetTimer()
	// One chunk per row, the order rotated by one each chunk (as in BenchmarkPeers).
	elapsed := make([]time.Duration, len(rows))
	for c := range rows {
		n := b.N / len(rows)
		if c < b.N%len(rows) {
			n++
		}
		for k := range rows {
			ri := (k + c) % len(rows)
			elapsed[ri] += rows[ri].run(n, &clock.sent)
		}
	}
	b.StopTimer()
	rate := map[string]float64{}
	for ri, r := range rows {
		rate[r.name] = float64(b.N) / elapsed[ri].Seconds()
		b.ReportMetric(rate[r.name], r.name+"-msg/s")
	}
	b.ReportMetric(rate["river"]/rate["inbox"], "river/inbox")
	b.ReportMetric(rate["deferred"]/rate["inbox"], "deferred/inbox")
	b.ReportMetric(rate["deferred"]/rate["river"], "ratio-deferred-river")
	for _, name := range []string{"river", "deferred"} {
		xs := clock.samples(name)
		if len(xs) != b.N {
			b.Fatalf("%s: %d latencies timed, want %d", name, len(xs), b.N)
		}
		b.ReportMetric(percentile(xs, 50), name+"-e2e-p50-ms")
		b.ReportMetric(percentile(xs, 99), name+"-e2e-p99-ms")
	}
	b.ReportMetric(0, "ns/op")
	checkStoreThenProcess(b, sch, uint64(warm+b.N), ib.Stats().Processed, inserted.Load(), dib)
}

// checkStoreThenProcess checks the business state: one River job per message and one done
// deferred row per message, each applied once, and the immediate inbox's UPDATEs.
func checkStoreThenProcess(b *testing.B, sch *testenv.Schema, want, processed, inserted uint64, dib *deferred.Inbox) {
	b.Helper()
	ctx := context.Background()
	var sum, done int64
	if err := sch.Pool.QueryRow(ctx, "SELECT coalesce(sum(balance), 0) FROM accounts").Scan(&sum); err != nil {
		b.Fatal(err)
	}
	if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+dib.Table()+" WHERE status = 'done'").Scan(&done); err != nil {
		b.Fatal(err)
	}
	if processed != want || inserted != want || uint64(done) != want || uint64(sum) != 3*want {
		b.Fatalf("inbox processed %d, %d River jobs inserted, %d deferred rows done, balances sum to %d; want %d, %d, %d and %d",
			processed, inserted, done, sum, want, want, want, 3*want)
	}
}

// startRiver migrates River's tables, starts its client (Queues MaxWorkers = slots) and adds
// the river-<slot> handlers that insert a job unique by message ID. worked counts the jobs whose
// work committed, inserted the jobs inserted (not skipped as duplicates).
func startRiver(b *testing.B, sch *testenv.Schema, router *message.Router, sub message.Subscriber, slots, accounts int, clock *e2eClock) (worked, inserted *atomic.Uint64) {
	ctx := context.Background()
	migrator, err := rivermigrate.New(riverpgxv5.New(sch.Pool), &rivermigrate.Config{Schema: sch.Name})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		b.Fatal(err)
	}
	worked, inserted = new(atomic.Uint64), new(atomic.Uint64)
	workers := river.NewWorkers()
	river.AddWorker(workers, &creditWorker{pool: sch.Pool, done: worked, clock: clock})
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
	for s := range slots {
		topic := fmt.Sprintf("river-%d", s)
		router.AddConsumerHandler(topic, topic, sub, func(msg *message.Message) error {
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
	return worked, inserted
}

// startDeferred migrates a store-then-process inbox (consumer "deferred", Workers = slots, the
// other fields at their defaults) on a pool of its own of -pool connections, whose tracer times
// each row's commit, starts its workers running work, and adds the deferred-<slot> handlers
// (Inbox.Receive).
func startDeferred(b *testing.B, sch *testenv.Schema, router *message.Router, sub message.Subscriber, slots int, clock *e2eClock, work func(context.Context, pgx.Tx) error) *deferred.Inbox {
	ctx := context.Background()
	tracer := &commitTracer{clock: clock}
	pcfg := sch.Pool.Config()
	pcfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	dib, err := deferred.New(deferred.Config{Pool: pool, Schema: sch.Name, ConsumerName: "deferred", Workers: slots}, nil)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := dib.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	w := dib.NewConsumerWorkers(func(msg *message.Message) error {
		tx, _ := pgstore.TxFromContext(msg.Context())
		if err := work(msg.Context(), tx); err != nil {
			return err
		}
		// The next round trip on this connection is the row's done-mark and COMMIT.
		tracer.open.Store(tx.Conn(), msg.UUID)
		return nil
	})
	go func() { _ = w.Run(ctx) }()
	<-w.Running()
	b.Cleanup(func() { _ = w.Close() })
	for s := range slots {
		topic := fmt.Sprintf("deferred-%d", s)
		router.AddConsumerHandler(topic, topic, sub, dib.Receive)
	}
	return dib
}

// waitCommitted waits until committed() reaches n, failing b after 2 minutes.
func waitCommitted(b *testing.B, name string, committed func() uint64, n uint64) {
	deadline := time.Now().Add(2 * time.Minute)
	for committed() < n {
		if time.Now().After(deadline) {
			b.Fatalf("%s: %d of %d messages worked after 2 minutes", name, committed(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// e2eClock times messages from just before their Publish (sent: message UUID -> time.Time)
// to the commit of their work (committed), per row, in milliseconds.
type e2eClock struct {
	sent sync.Map
	mu   sync.Mutex
	ms   map[string][]float64
}

// committed records the latency of message id, if its Publish was timed.
func (c *e2eClock) committed(row, id string) {
	t0, ok := c.sent.LoadAndDelete(id)
	if !ok {
		return
	}
	d := time.Since(t0.(time.Time))
	c.mu.Lock()
	c.ms[row] = append(c.ms[row], float64(d.Microseconds())/1000)
	c.mu.Unlock()
}

func (c *e2eClock) samples(row string) []float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.ms[row])
}

// percentile is the p-th percentile (nearest rank) of xs.
func percentile(xs []float64, p int) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[min(len(s)-1, (len(s)*p+99)/100-1)]
}

// commitTracer is the deferred pool's pgx tracer: the handler stores its message's UUID under
// its row's connection (open) once its work succeeded, and the end of the next batch on that
// connection, the workers' done-mark and COMMIT in one round trip, is the work's commit.
type commitTracer struct {
	clock *e2eClock
	open  sync.Map // *pgx.Conn -> message UUID
}

func (t *commitTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}

func (t *commitTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (t *commitTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (t *commitTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (t *commitTracer) TraceBatchEnd(_ context.Context, conn *pgx.Conn, data pgx.TraceBatchEndData) {
	if id, ok := t.open.LoadAndDelete(conn); ok && data.Err == nil {
		t.clock.committed("deferred", id.(string))
	}
}
