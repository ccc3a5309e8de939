package deferred_test

import (
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// The benchmarks of the store-then-process inbox; one command runs them all (under three
// minutes for -count 3 on a quiet machine of this kind):
//
//	go test ./middleware/deferred -run '^$' -bench . -benchtime 1000x -count 3
//
// Each reports rows (or messages) per second and, where it measures latency, p50 and p99 in
// milliseconds; the ratios against the immediate inbox come from the same iteration.

const benchAccounts = 1000

// benchCredit is the handler of every benchmark: one UPDATE of an account in the row's (or
// the claim's) transaction.
func benchCredit(msg *message.Message) error {
	tx, _ := pgstore.TxFromContext(msg.Context())
	id, _ := strconv.Atoi(msg.Metadata.Get("account"))
	_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 1 WHERE id = $1", id)
	return err
}

// BenchmarkWorkers: rows per second handled by workers, batch sizes 1, 10 and 50 times 1, 4
// and 8 workers, over b.N rows stored beforehand (no aggregate key: unordered).
func BenchmarkWorkers(b *testing.B) {
	for _, batch := range []int{1, 10, 50} {
		for _, workers := range []int{1, 4, 8} {
			b.Run(fmt.Sprintf("batch=%d/workers=%d", batch, workers), func(b *testing.B) {
				s := testenv.NewSchema(b, int32(workers)+2)
				s.CreateAccounts(b, benchAccounts)
				ib := inboxOn(b, s.Pool, s.Name, deferred.Config{BatchSize: batch, Workers: workers})
				s.Exec(b, `INSERT INTO inbox_deferred (message_id, consumer_name, message_uuid, payload, payload_hash, metadata)
					SELECT 'm-' || g, 'billing', 'm-' || g, '\x'::bytea, sha256('\x'::bytea), json_build_object('account', (g % $2::int + 1)::text)
					FROM generate_series(1, $1::int) g`, b.N, benchAccounts)
				s.Exec(b, "VACUUM ANALYZE inbox_deferred")
				w := ib.NewConsumerWorkers(benchCredit)
				b.ResetTimer()
				start := time.Now()
				runWorkers(b, w)
				for ib.Counters().Done < uint64(b.N) {
					time.Sleep(5 * time.Millisecond)
				}
				b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "rows/s")
				b.StopTimer()
				_ = w.Close()
			})
		}
	}
}

// BenchmarkReceipt: messages per second stored by Receive, against the immediate inbox
// running the same handler in its claim's transaction, 8 concurrent deliveries, interleaved
// in one iteration (ratio = store-then-process / immediate).
func BenchmarkReceipt(b *testing.B) {
	s := testenv.NewSchema(b, 10)
	s.CreateAccounts(b, benchAccounts)
	ib := inboxOn(b, s.Pool, s.Name, deferred.Config{})
	imm, err := inbox.New(inbox.Config{Store: s.Store(b), ConsumerName: "bench"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	h := imm.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, benchCredit(msg) })
	run := func(tag string, f func(*message.Message) error) time.Duration {
		var next atomic.Int64
		var wg sync.WaitGroup
		start := time.Now()
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for k := next.Add(1); k <= int64(b.N); k = next.Add(1) {
					m := message.NewMessage(tag+strconv.FormatInt(k, 10), []byte(`{"amount":1}`))
					m.Metadata.Set("account", strconv.FormatInt(k%benchAccounts+1, 10))
					if err := f(m); err != nil {
						b.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		return time.Since(start)
	}
	b.ResetTimer()
	dStore := run("d-", ib.Receive)
	dImm := run("i-", func(m *message.Message) error { _, err := h(m); return err })
	b.ReportMetric(float64(b.N)/dStore.Seconds(), "stp-msg/s")
	b.ReportMetric(float64(b.N)/dImm.Seconds(), "immediate-msg/s")
	b.ReportMetric(dImm.Seconds()/dStore.Seconds(), "ratio")
}

// BenchmarkLatency: with idle workers, b.N messages received one at a time (10 ms apart):
// wake-up latency (the receipt's return to the handler's start: notification and claim) and
// end-to-end latency (the receipt's start to the row's commit) at p50 and p99, against the
// immediate inbox's end-to-end latency (the delivery's start to its commit).
func BenchmarkLatency(b *testing.B) {
	s := testenv.NewSchema(b, 8)
	s.CreateAccounts(b, benchAccounts)
	ib := inboxOn(b, s.Pool, s.Name, deferred.Config{Workers: 4, PollInterval: time.Second})
	imm, err := inbox.New(inbox.Config{Store: s.Store(b), ConsumerName: "bench"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	started := make(chan time.Time, 1)
	var mu sync.Mutex
	var wake, e2e, immE2E []float64
	runWorkers(b, ib.NewConsumerWorkers(func(msg *message.Message) error {
		started <- time.Now()
		return benchCredit(msg)
	}))
	h := imm.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, benchCredit(msg) })
	time.Sleep(300 * time.Millisecond) // LISTEN in place
	b.ResetTimer()
	for k := range b.N {
		m := message.NewMessage("lat-"+strconv.Itoa(k), []byte(`{}`))
		m.Metadata.Set("account", strconv.Itoa(k%benchAccounts+1))
		t0 := time.Now()
		if err := ib.Receive(m); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		h0 := <-started
		for ib.Counters().Done < uint64(k+1) {
			time.Sleep(100 * time.Microsecond)
		}
		mu.Lock()
		wake = append(wake, ms(h0.Sub(t1)))
		e2e = append(e2e, ms(time.Since(t0)))
		mu.Unlock()
		im := message.NewMessage("imm-"+strconv.Itoa(k), []byte(`{}`))
		im.Metadata.Set("account", strconv.Itoa(k%benchAccounts+1))
		i0 := time.Now()
		if _, err := h(im); err != nil {
			b.Fatal(err)
		}
		immE2E = append(immE2E, ms(time.Since(i0)))
		time.Sleep(10 * time.Millisecond)
	}
	b.StopTimer()
	b.ReportMetric(pct(wake, 50), "wake-p50-ms")
	b.ReportMetric(pct(wake, 99), "wake-p99-ms")
	b.ReportMetric(pct(e2e, 50), "stp-e2e-p50-ms")
	b.ReportMetric(pct(e2e, 99), "stp-e2e-p99-ms")
	b.ReportMetric(pct(immE2E, 50), "immediate-e2e-p50-ms")
	b.ReportMetric(pct(immE2E, 99), "immediate-e2e-p99-ms")
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// pct is the p-th percentile (nearest rank) of xs.
func pct(xs []float64, p int) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[min(len(s)-1, (len(s)*p+99)/100-1)]
}
