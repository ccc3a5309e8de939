package pgstore_test

import (
	"context"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// BenchmarkPurgeUnderClaims measures what a purge costs the hot path (failure scenario 21):
// 1,000,000 expired rows (UUID text keys) are purged with the defaults (5,000 rows per
// transaction, 50 ms pause) while 4 workers claim and commit new keys at a steady rate (one
// every 10 ms each, about 400 claims/s). It reports the claim latency (BEGIN + INSERT claim +
// COMMIT) p50 and p99 for 6 s without the purge, then during the purge, their ratio (target:
// p99 during purge at most 2x), the purge's rows/s and the VACUUM after it. One scenario per
// iteration:
//
//	go test ./middleware/pgstore -run '^$' -bench PurgeUnderClaims -benchtime 1x -count 3
//
// INBOX_BENCH_PURGE_ROWS overrides the 1,000,000 rows (e.g. 100000 for a quick look);
// INBOX_BENCH_PURGE_PAUSE and INBOX_BENCH_PURGE_BATCH the purge's pause (a Go duration) and
// batch size (rows), defaults DefaultPurgePause and DefaultPurgeBatchSize.
func BenchmarkPurgeUnderClaims(b *testing.B) {
	rows := 1_000_000
	if v, err := strconv.Atoi(os.Getenv("INBOX_BENCH_PURGE_ROWS")); err == nil && v > 0 {
		rows = v
	}
	var p pgstore.PurgeExpiredParams
	if v, err := time.ParseDuration(os.Getenv("INBOX_BENCH_PURGE_PAUSE")); err == nil && v > 0 {
		p.Pause = v
	}
	if v, err := strconv.Atoi(os.Getenv("INBOX_BENCH_PURGE_BATCH")); err == nil && v > 0 {
		p.BatchSize = v
	}
	for i := 0; i < b.N; i++ {
		purgeUnderClaims(b, rows, p)
	}
}

func purgeUnderClaims(b *testing.B, rows int, p pgstore.PurgeExpiredParams) {
	b.StopTimer()
	sch := testenv.NewSchema(b, 8)
	ctx := context.Background()
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Retention: inbox.Retention{Window: 2 * time.Hour, MaxRedelivery: time.Hour, Margin: time.Hour}})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := s.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	long := func(q string, args ...any) {
		lctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		defer cancel()
		if _, err := sch.Pool.Exec(lctx, q, args...); err != nil {
			b.Fatalf("%.50s: %v", q, err)
		}
	}
	// A bulk load: the table's two indexes are dropped, the rows inserted, and the same
	// indexes built again (much faster than a million index insertions), then VACUUM ANALYZE.
	load, err := sch.Pool.Acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	for _, q := range []string{
		"SET maintenance_work_mem = '256MB'",
		"ALTER TABLE inbox_processed_messages DROP CONSTRAINT inbox_processed_messages_pkey",
		"DROP INDEX inbox_processed_messages_received_at_idx",
		"INSERT INTO inbox_processed_messages (message_id, consumer_name, received_at, payload_hash)" +
			" SELECT gen_random_uuid()::text, 'billing', now() - interval '3 hours' + g * interval '1 ms', sha256(g::text::bytea)" +
			" FROM generate_series(1, " + strconv.Itoa(rows) + ") g",
		"ALTER TABLE inbox_processed_messages ADD PRIMARY KEY (message_id, consumer_name)",
		"CREATE INDEX inbox_processed_messages_received_at_idx ON inbox_processed_messages (received_at)",
		"VACUUM ANALYZE inbox_processed_messages",
	} {
		lctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		_, err := load.Exec(lctx, q)
		cancel()
		if err != nil {
			b.Fatalf("%.50s: %v", q, err)
		}
	}
	load.Release()

	// claims runs the steady claim load until stop is closed and returns the latencies.
	claims := func(stop <-chan struct{}) []time.Duration {
		var mu sync.Mutex
		var lat []time.Duration
		var wg sync.WaitGroup
		for w := 0; w < 4; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				tick := time.NewTicker(10 * time.Millisecond)
				defer tick.Stop()
				for {
					select {
					case <-stop:
						return
					case <-tick.C:
					}
					start := time.Now()
					tx, res, err := s.Claim(ctx, plain(uuid.NewString(), "billing"))
					if err != nil || res.Decision != contract.Run {
						b.Errorf("claim: %+v, %v", res, err)
						return
					}
					if err := tx.Commit(ctx); err != nil {
						b.Errorf("commit: %v", err)
						return
					}
					d := time.Since(start)
					mu.Lock()
					lat = append(lat, d)
					mu.Unlock()
				}
			}()
		}
		<-stop
		wg.Wait()
		return lat
	}
	pct := func(l []time.Duration, p float64) float64 {
		slices.Sort(l)
		if len(l) == 0 {
			return 0
		}
		return float64(l[int(float64(len(l)-1)*p)].Microseconds()) / 1000
	}

	stop := make(chan struct{})
	go func() { time.Sleep(6 * time.Second); close(stop) }()
	base := claims(stop)

	b.StartTimer()
	stop = make(chan struct{})
	done := make(chan []time.Duration)
	go func() { done <- claims(stop) }()
	start := time.Now()
	rep, err := s.PurgeExpired(ctx, p)
	took := time.Since(start)
	close(stop)
	during := <-done
	b.StopTimer()
	if err != nil || rep.Tables[0].Rows != int64(rows) {
		b.Fatalf("purge: %+v, %v", rep.Tables, err)
	}
	vstart := time.Now()
	long("VACUUM inbox_processed_messages")
	vacuum := time.Since(vstart)

	b50, b99, d50, d99 := pct(base, 0.5), pct(base, 0.99), pct(during, 0.5), pct(during, 0.99)
	b.ReportMetric(b50, "base_p50_ms")
	b.ReportMetric(b99, "base_p99_ms")
	b.ReportMetric(d50, "purge_p50_ms")
	b.ReportMetric(d99, "purge_p99_ms")
	b.ReportMetric(d99/b99, "p99_ratio")
	b.ReportMetric(float64(rows)/took.Seconds(), "purged_rows/s")
	b.ReportMetric(vacuum.Seconds(), "vacuum_s")
	b.Logf("%d rows purged in %s (%d batches); claims: %d without (p50 %.2f ms, p99 %.2f ms), %d during (p50 %.2f ms, p99 %.2f ms); VACUUM after: %s",
		rows, took.Round(time.Millisecond), rep.Tables[0].Batches, len(base), b50, b99, len(during), d50, d99, vacuum.Round(time.Millisecond))
}
