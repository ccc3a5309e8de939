package adaptertest

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/inboxtest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// Benchmark measures messages per second through the broker with the inbox, against the same
// handler (one UPDATE) in a bare transaction without a claim, in one run: for each mode it
// starts handlers handlers of one consumer group on a fresh topic, warms them up with one
// message each, then times publishing its share of b.N messages until all are consumed; the
// two modes alternate in three rounds. It reports
// bare-msg/s, inbox-msg/s and their ratio (inbox/bare).
func Benchmark(b *testing.B, h Harness, handlers int) {
	if h.Timeout == 0 {
		h.Timeout = 60 * time.Second
	}
	sch := inboxtest.NewSchema(b, "bench", 24)
	store := sch.Store(b)
	sch.CreateAccounts(b, 1000)
	var ib *inbox.Inbox

	update := func(ctx context.Context, tx pgx.Tx, m *message.Message) error {
		n, _ := strconv.Atoi(m.Metadata.Get("n"))
		_, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + 1 WHERE id = $1", n%1000+1)
		return err
	}
	// run uses a broker of its own: closing a Watermill router closes its subscribers.
	run := func(name string, n int, mw message.HandlerMiddleware, handler func(*message.Message) error) time.Duration {
		broker, err := h.NewBroker(sch.Pool, randomName("bench"))
		if err != nil {
			b.Fatal(err)
		}
		defer broker.Close()
		if ib == nil {
			ib = newInbox(b, store, broker)
		}
		topic := randomName("bench_" + name)
		publish := func(n int) {
			for i := range n {
				m := message.NewMessage(uuid.NewString(), []byte(`{}`))
				m.Metadata.Set("n", strconv.Itoa(i))
				if err := broker.Publisher.Publish(topic, m); err != nil {
					b.Fatal(err)
				}
			}
		}
		var done atomic.Int64
		r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		if err != nil {
			b.Fatal(err)
		}
		r.AddMiddleware(mw)
		for i := range handlers {
			r.AddConsumerHandler(fmt.Sprintf("%s-%d", name, i), topic, broker.Subscriber, func(m *message.Message) error {
				if err := handler(m); err != nil {
					return err
				}
				done.Add(1)
				return nil
			})
		}
		go func() { _ = r.Run(context.Background()) }()
		wait := func(n int64) {
			deadline := time.Now().Add(h.Timeout)
			for done.Load() < n {
				if time.Now().After(deadline) {
					b.Fatalf("%s: %d of %d messages consumed after %v", name, done.Load(), n, h.Timeout)
				}
				time.Sleep(2 * time.Millisecond)
			}
		}
		// Warm up: subscriptions joined (consumer-group rebalances, queue declarations) and
		// connections open before the clock starts.
		publish(handlers)
		wait(int64(handlers))
		start := time.Now()
		publish(n)
		wait(int64(handlers + n))
		elapsed := time.Since(start)
		_ = r.Close()
		return elapsed
	}
	bareMW := func(hf message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			tx, err := sch.Pool.BeginTx(m.Context(), pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
			if err != nil {
				return nil, err
			}
			if err := update(m.Context(), tx, m); err != nil {
				_ = tx.Rollback(context.WithoutCancel(m.Context()))
				return nil, err
			}
			if err := tx.Commit(context.WithoutCancel(m.Context())); err != nil {
				return nil, err
			}
			return hf(m) // counts the message
		}
	}
	inboxMW := func(h message.HandlerFunc) message.HandlerFunc { return ib.Middleware(h) }
	inboxHandler := func(m *message.Message) error {
		tx, _ := pgstore.TxFromContext(m.Context())
		return update(m.Context(), tx, m)
	}
	b.ResetTimer()
	// Alternate the modes in rounds, so both see the same machine conditions.
	const rounds = 3
	var bareT, inboxT time.Duration
	for r := range rounds {
		n := b.N / rounds
		if r < b.N%rounds {
			n++
		}
		bareT += run("bare", n, bareMW, func(*message.Message) error { return nil })
		inboxT += run("inbox", n, inboxMW, inboxHandler)
	}
	b.StopTimer()
	bare := float64(b.N) / bareT.Seconds()
	withInbox := float64(b.N) / inboxT.Seconds()
	b.ReportMetric(bare, "bare-msg/s")
	b.ReportMetric(withInbox, "inbox-msg/s")
	b.ReportMetric(withInbox/bare, "ratio")
	b.ReportMetric(0, "ns/op")
}
