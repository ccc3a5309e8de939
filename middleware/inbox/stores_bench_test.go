package inbox_test

import (
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// BenchmarkStores measures messages per second through one inbox (immediate mode) whose
// Stores hold 1, 2 and 3 databases on the local PostgreSQL, at 32 concurrent deliveries
// (goroutines calling the middleware as the router's would, each message a new key routed
// round-robin over the databases, its handler crediting an account in the inbox
// transaction). msg/s is the figure; on one machine the databases share one disk's fsync
// and one CPU, so it says what routing costs, not what separate machines would reach.
//
//	go test ./middleware/inbox -run '^$' -bench Stores -benchtime 3000x -count 3
func BenchmarkStores(b *testing.B) {
	for _, n := range []int{1, 2, 3} {
		b.Run(fmt.Sprintf("databases=%d/deliveries=32", n), func(b *testing.B) { benchStores(b, n, 32) })
	}
}

func benchStores(b *testing.B, databases, slots int) {
	names := []string{"a", "b", "c"}[:databases]
	dbs := newTenantDBs(b, int32(slots/databases)+4, names...)
	credit := newTenantCredit(dbs)
	ib, err := inbox.New(inbox.Config{Stores: storesOf(dbs), Route: routeByTenant(b), ConsumerName: "bench"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	h := ib.Middleware(credit.handle)
	run := watermill.NewShortUUID() // keys new in every run of the benchmark function
	msgs := make([]*message.Message, b.N)
	for k := range msgs {
		msgs[k] = tenantMsg(names[k%databases], run+"-"+strconv.Itoa(k), k%10+1, 1)
	}
	var next atomic.Int64
	var failed atomic.Int64
	var wg sync.WaitGroup
	b.ResetTimer()
	start := time.Now()
	for range slots {
		wg.Go(func() {
			for {
				k := next.Add(1) - 1
				if k >= int64(len(msgs)) {
					return
				}
				if err := deliver(h, msgs[k]); err != nil {
					failed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	if n := failed.Load(); n > 0 {
		b.Fatalf("%d deliveries failed", n)
	}
	if st := ib.Stats(); st.Processed != uint64(b.N) {
		b.Fatalf("%d processed, want %d", st.Processed, b.N)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "msg/s")
}
