package sqlstore_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/sqlstore"
)

// benchConcurrency is the number of concurrent deliveries (or bare transactions).
const benchConcurrency = 8

// BenchmarkSQLStoreVsBareTx measures, per dialect, a delivery through the inbox on sqlstore
// (claim, the handler's UPDATE of one of 64 accounts, COMMIT) against the bare business
// transaction (BEGIN, the same UPDATE, COMMIT), both at 8 concurrent workers on a pool of 12
// connections. It reports msg/s; compare the ratio inbox/bare within one run.
func BenchmarkSQLStoreVsBareTx(b *testing.B) {
	for _, d := range dialects {
		b.Run(d.String(), func(b *testing.B) {
			e := newEnv(b, d, benchConcurrency+4)
			s := e.store(b, sqlstore.Config{})
			e.exec(b, "CREATE TABLE accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL)")
			for id := range 64 {
				e.exec(b, "INSERT INTO accounts (id, balance) VALUES ("+e.ph(1)+", 0)", id)
			}
			update := "UPDATE accounts SET balance = balance + 1 WHERE id = " + e.ph(1)
			ib, err := inbox.New(inbox.Config{Store: s, ConsumerName: "bench"}, nil)
			if err != nil {
				b.Fatal(err)
			}
			h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := sqlstore.TxFromContext(msg.Context())
				_, err := tx.ExecContext(msg.Context(), update, msg.Metadata.Get("account"))
				return nil, err
			})
			var seq atomic.Int64
			b.Run("inbox", func(b *testing.B) {
				parallel(b, func(n int64) error {
					msg := message.NewMessage(fmt.Sprintf("bench-%d-%d", time.Now().UnixNano(), seq.Add(1)), []byte(`{}`))
					msg.Metadata.Set("account", fmt.Sprint(n%64))
					msg.SetContext(context.Background())
					_, err := h(msg)
					return err
				})
			})
			b.Run("bare", func(b *testing.B) {
				parallel(b, func(n int64) error {
					tx, err := e.db.BeginTx(context.Background(), nil)
					if err != nil {
						return err
					}
					if _, err := tx.Exec(update, n%64); err != nil {
						_ = tx.Rollback()
						return err
					}
					return tx.Commit()
				})
			})
		})
	}
}

// parallel runs op b.N times on benchConcurrency goroutines and reports msg/s.
func parallel(b *testing.B, op func(n int64) error) {
	var next atomic.Int64
	var wg sync.WaitGroup
	b.ResetTimer()
	start := time.Now()
	for range benchConcurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				n := next.Add(1)
				if n > int64(b.N) {
					return
				}
				if err := op(n); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msg/s")
}
