package bench

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

var (
	poolFlag       = flag.Int("pool", 10, "BenchmarkPeers, BenchmarkStoreThenProcess: the pgx pool's size (max connections) shared by every mode")
	peerModesFlag  = flag.String("peer-modes", "dedup,bare,inbox,inbox-dlq,batched", "BenchmarkPeers: comma-separated modes to run (dedup, bare, inbox, inbox-dlq, batched)")
	deliveriesFlag = flag.String("deliveries", "1,8,32,128", "BenchmarkPeers, BenchmarkStoreThenProcess: comma-separated concurrent deliveries")
)

// bareTxKey carries the bare transaction of the bare and dedup modes in the message context.
type bareTxKey struct{}

// txOf returns the transaction the handler writes in: the bare one, or the inbox's.
func txOf(ctx context.Context) pgx.Tx {
	if tx, ok := ctx.Value(bareTxKey{}).(pgx.Tx); ok {
		return tx
	}
	tx, _ := pgstore.TxFromContext(ctx)
	return tx
}

// peerEnv is what the modes of one BenchmarkPeers run share.
type peerEnv struct {
	sch   *testenv.Schema
	store *pgstore.Store
	slots int // concurrent deliveries of this run
}

// bare wraps h in BEGIN ... COMMIT on the pool: the transaction a handler needs anyway.
func (e *peerEnv) bare(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		tx, err := e.sch.Pool.BeginTx(msg.Context(), pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
		if err != nil {
			return nil, err
		}
		orig := msg.Context()
		msg.SetContext(context.WithValue(orig, bareTxKey{}, tx))
		out, err := h(msg)
		msg.SetContext(orig)
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(orig))
			return nil, err
		}
		return out, tx.Commit(context.WithoutCancel(orig))
	}
}

// peerMode is one row of BenchmarkPeers: a middleware around the handler (which runs one
// UPDATE in txOf's transaction), and how many messages it applied (nil: counted by the
// benchmark from the handler's successful returns).
type peerMode struct {
	name string
	// setup returns the middleware of the mode.
	setup func(e *peerEnv) (message.HandlerMiddleware, error)
}

// peerModes are the rows, in the order they run.
func peerModes() []peerMode {
	modes := []peerMode{
		{name: "dedup", setup: func(e *peerEnv) (message.HandlerMiddleware, error) {
			// Watermill's in-memory Deduplicator (the alternative users have today) in front
			// of the bare transaction, keyed by the message UUID, the inbox's key (its default
			// key, an Adler-32 of the payload, would merge distinct messages with equal
			// payloads). It records the key before the handler runs and forgets it after a
			// minute or a restart: no guarantee across processes or failures.
			d := &wmmiddleware.Deduplicator{KeyFactory: func(m *message.Message) (string, error) { return m.UUID, nil }}
			mw := d.Middleware
			return func(h message.HandlerFunc) message.HandlerFunc { return mw(e.bare(h)) }, nil
		}},
		{name: "bare", setup: func(e *peerEnv) (message.HandlerMiddleware, error) {
			return e.bare, nil
		}},
		{name: "inbox", setup: func(e *peerEnv) (message.HandlerMiddleware, error) {
			ib, err := inbox.New(inbox.Config{Store: e.store, ConsumerName: "peers"}, nil)
			if err != nil {
				return nil, err
			}
			return ib.Middleware, nil
		}},
		// The immediate inbox with a dead-letter topic (durable attempt counting) on a broker
		// that signals first deliveries, as RabbitMQ's redelivered flag or NATS's delivery
		// count does: a first delivery that succeeds costs what the plain inbox costs.
		{name: "inbox-dlq", setup: func(e *peerEnv) (message.HandlerMiddleware, error) {
			dead := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
			ib, err := inbox.New(inbox.Config{Store: e.store, ConsumerName: "peers-dlq",
				DeadLetterPublisher: dead, DeadLetterTopic: "dead",
				Redelivery: func(*message.Message) inbox.Redelivery { return inbox.FirstDelivery }}, nil)
			if err != nil {
				return nil, err
			}
			return ib.Middleware, nil
		}},
		// The batched inbox (group commit), sized as docs/design.md advises: a batch of about
		// half the concurrent deliveries (at most 16), so one batch gathers while another
		// commits; with one delivery it is the immediate inbox (a batch of one is off).
		{name: "batched", setup: func(e *peerEnv) (message.HandlerMiddleware, error) {
			ib, err := inbox.New(inbox.Config{Store: e.store, ConsumerName: "batched",
				Batch: inbox.BatchConfig{Size: min(max(e.slots/2, 1), 16)}}, nil)
			if err != nil {
				return nil, err
			}
			return ib.Middleware, nil
		}},
		// The chart (tests/bench/cmd/benchchart) draws a line for every <mode>-msg/s metric.
	}
	want := map[string]bool{}
	for _, m := range strings.Split(*peerModesFlag, ",") {
		want[strings.TrimSpace(m)] = true
	}
	var out []peerMode
	for _, m := range modes {
		if want[m.name] {
			out = append(out, m)
		}
	}
	return out
}

// deliveryCounts parses -deliveries.
func deliveryCounts(b *testing.B) []int {
	var out []int
	for _, s := range strings.Split(*deliveriesFlag, ",") {
		var n int
		if _, err := fmt.Sscan(strings.TrimSpace(s), &n); err != nil || n < 1 {
			b.Fatalf("-deliveries: %q is not a positive number", s)
		}
		out = append(out, n)
	}
	return out
}

// BenchmarkPeers compares, on GoChannel, what a user can put around a handler that runs one
// UPDATE on one of 10,000 account rows: Watermill's in-memory Deduplicator in front of a bare
// transaction (dedup), the bare transaction alone (bare: BEGIN, the UPDATE, COMMIT; no
// deduplication at all), the immediate inbox (inbox: the claim pipelined with BEGIN, the
// UPDATE, COMMIT), the same with a dead-letter topic on a broker that signals first deliveries
// (inbox-dlq) and the batched inbox (batched), at 1, 8, 32 and 128 concurrent deliveries. It reports <mode>-msg/s for each
// mode and <mode>/bare. b.N is the number of messages per mode.
//
// Each delivery is acked before its publisher sends the next message
// (BlockPublishUntilSubscriberAck), so the number of publishers is exactly the number of
// concurrent deliveries. The modes run in the same iteration, interleaved in one chunk per
// mode whose order rotates (every mode runs once in every position), so their ratios are
// measured under the same machine load. Every mode shares one pool of -pool
// connections (10 by default, this machine's rule for a test process): beyond 10 deliveries
// the extra ones wait for a connection, as they would in a service whose pool is sized for its
// database rather than for its consumer's concurrency.
//
//	cd tests/bench && go test . -run '^$' -bench Peers -benchtime 2000x -count 3
func BenchmarkPeers(b *testing.B) {
	for _, n := range deliveryCounts(b) {
		b.Run(fmt.Sprintf("deliveries=%d", n), func(b *testing.B) { benchPeers(b, n) })
	}
}

func benchPeers(b *testing.B, slots int) {
	const accounts = 10000
	sch := testenv.NewSchema(b, int32(*poolFlag))
	e := &peerEnv{sch: sch, store: sch.Store(b), slots: slots}
	sch.CreateAccounts(b, accounts)
	modes := peerModes()

	handler := func(msg *message.Message) ([]*message.Message, error) {
		_, err := txOf(msg.Context()).Exec(msg.Context(), "UPDATE accounts SET balance = balance + 1 WHERE id = $1", rand.IntN(accounts)+1)
		return nil, err
	}
	pubsub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		b.Fatal(err)
	}
	applied := make([]*counter, len(modes))
	for mi, m := range modes {
		mw, err := m.setup(e)
		if err != nil {
			b.Fatal(err)
		}
		applied[mi] = new(counter)
		h := mw(applied[mi].wrap(handler))
		for s := range slots {
			topic := fmt.Sprintf("%s-%d", m.name, s)
			router.AddConsumerHandler(topic, topic, pubsub, func(msg *message.Message) error {
				_, err := h(msg)
				return err
			})
		}
	}
	go func() { _ = router.Run(context.Background()) }()
	<-router.Running()
	b.Cleanup(func() { _ = router.Close(); _ = pubsub.Close() })

	for _, m := range modes {
		publishSlots(b, pubsub, m.name, slots, 2*slots) // warm up: connections, prepared statements
	}
	b.ResetTimer()
	elapsed := make([]time.Duration, len(modes))
	// One chunk per mode, the order rotated by one each chunk, so every mode runs once in
	// every position: a mode's rate depends on the mode that ran just before it
	// (measured on 2026-12-01: the mode right after bare ran about 0.05 of the bare rate
	// slower).
	chunks := len(modes)
	for c := range chunks {
		n := b.N / chunks
		if c < b.N%chunks {
			n++
		}
		for k := range modes {
			mi := (k + c) % len(modes)
			elapsed[mi] += publishSlots(b, pubsub, modes[mi].name, slots, n)
		}
	}
	b.StopTimer()
	rates := map[string]float64{}
	for mi, m := range modes {
		rates[m.name] = float64(b.N) / elapsed[mi].Seconds()
		b.ReportMetric(rates[m.name], m.name+"-msg/s")
	}
	for _, m := range modes {
		if m.name != "bare" && rates["bare"] > 0 {
			b.ReportMetric(rates[m.name]/rates["bare"], m.name+"/bare")
		}
	}
	b.ReportMetric(0, "ns/op")

	// Business state: every mode applied each of its messages once (GoChannel never
	// redelivers here), and the balances hold exactly the committed UPDATEs.
	var total uint64
	for mi, m := range modes {
		if got, want := applied[mi].n(), uint64(b.N+2*slots); got != want {
			b.Fatalf("%s applied %d messages, want %d", m.name, got, want)
		}
		total += applied[mi].n()
	}
	var sum int64
	if err := sch.Pool.QueryRow(context.Background(), "SELECT coalesce(sum(balance), 0) FROM accounts").Scan(&sum); err != nil {
		b.Fatal(err)
	}
	if uint64(sum) != total {
		b.Fatalf("balances sum to %d, want %d", sum, total)
	}
}

// counter counts a handler's successful returns.
type counter struct{ count atomic.Uint64 }

func (c *counter) wrap(h message.HandlerFunc) message.HandlerFunc {
	return func(m *message.Message) ([]*message.Message, error) {
		out, err := h(m)
		if err == nil {
			c.count.Add(1)
		}
		return out, err
	}
}

func (c *counter) n() uint64 { return c.count.Load() }

// publishSlots publishes n messages to prefix-0..prefix-(slots-1), one publisher per slot, each
// waiting for the ack of its message before it sends the next, and returns the elapsed time.
func publishSlots(b testing.TB, pub message.Publisher, prefix string, slots, n int) time.Duration {
	return publishSlotsTimed(b, pub, prefix, slots, n, nil)
}

// publishSlotsTimed is publishSlots storing, when sent is not nil, each message's UUID with the
// time just before its Publish.
func publishSlotsTimed(b testing.TB, pub message.Publisher, prefix string, slots, n int, sent *sync.Map) time.Duration {
	start := time.Now()
	var wg sync.WaitGroup
	for s := range slots {
		share := n / slots
		if s < n%slots {
			share++
		}
		wg.Go(func() {
			for range share {
				msg := message.NewMessage(uuid.NewString(), nil)
				if sent != nil {
					sent.Store(msg.UUID, time.Now())
				}
				if err := pub.Publish(fmt.Sprintf("%s-%d", prefix, s), msg); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	return time.Since(start)
}
