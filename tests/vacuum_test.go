package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-inbox/watermill-inbox/inboxtest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// BenchmarkTableChurnAndVacuum measures what a long run leaves in the tables that churn,
// with autovacuum off as on this project's machines: three rounds of b.N healthy deliveries
// through an inbox with durable attempt counting (a dead-letter topic set) whose handler stores
// one receipt in the outbox, the last after an explicit VACUUM. It logs the size and dead
// tuples of the inbox, attempts and outbox tables after each step ("CHURN" lines), reports the
// sizes after the second round (no VACUUM) and at the end as <table>-MB-nov and <table>-MB-end
// and the time per delivery as ns/delivery (ns/op is suppressed), and asserts the business
// state: every payment applied once (the balances), b.N inbox rows per round, no attempts row
// left (a processed message's count is deleted), one outbox row per payment.
// docs/operations.md records the figures:
//
//	go test ./tests -run '^$' -bench TableChurnAndVacuum -benchtime 20000x -timeout 20m
func BenchmarkTableChurnAndVacuum(b *testing.B) {
	n := b.N
	b.StopTimer()
	sch := testenv.NewSchema(b, 10)
	store := setupBank(b, sch, 100)
	obCfg := outbox.Config{}
	if err := outbox.InitializeSchema(context.Background(), sch.Pool, obCfg); err != nil {
		b.Fatal(err)
	}
	ob, err := outbox.New(obCfg, nil)
	if err != nil {
		b.Fatal(err)
	}
	dead := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: bankConsumerName, Outbox: ob,
		DeadLetterPublisher: dead, DeadLetterTopic: "dead"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		var p payment
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return nil, inbox.Permanent(err)
		}
		tx, _ := pgstore.TxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + $1 WHERE id = $2", p.Amount, p.Account); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(watermill.NewUUID(), []byte(`{}`))}, nil
	})
	tables := map[string]string{"inbox": store.Table(), "attempts": store.AttemptsTable(), "outbox": obCfg.MessagesTable()}
	sizes := map[string]float64{}
	report := func(when, metric string) {
		for _, name := range []string{"inbox", "attempts", "outbox"} {
			var size, dead, live int64
			err := sch.Pool.QueryRow(context.Background(), `SELECT pg_total_relation_size($1::regclass),
				coalesce((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = $1::regclass), 0),
				coalesce((SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = $1::regclass), 0)`, tables[name]).Scan(&size, &dead, &live)
			if err != nil {
				b.Fatal(err)
			}
			b.Logf("CHURN %-32s %-8s %7.2f MB, live %7d, dead %7d", when, name, float64(size)/1e6, live, dead)
			if metric != "" {
				sizes[name+"-MB-"+metric] = float64(size) / 1e6
			}
		}
	}
	round := 0
	deliver := func() {
		b.StartTimer()
		defer b.StopTimer()
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for w := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := w; i < n; i += 8 {
					m := paymentMsg(b, fmt.Sprintf("r%d-%d", round, i), i%100+1, 1)
					m.Metadata.Set("n", fmt.Sprint(i))
					for _, err := range inboxtest.Deliver(h, m, 1, inboxtest.DeliverOptions{PublishTopic: "receipts"}) {
						if err != nil {
							errs <- err
							return
						}
					}
				}
			}()
		}
		wg.Wait()
		select {
		case err := <-errs:
			b.Fatal(err)
		default:
		}
		round++
	}
	vacuum := func() {
		for _, name := range []string{"inbox", "attempts", "outbox"} {
			if _, err := sch.Pool.Exec(context.Background(), "VACUUM "+tables[name]); err != nil {
				b.Fatal(err)
			}
		}
	}
	stat := func() { _, _ = sch.Pool.Exec(context.Background(), "SELECT pg_stat_force_next_flush()") }

	b.ResetTimer()
	deliver()
	stat()
	report(fmt.Sprintf("after %d deliveries", n), "")
	deliver()
	stat()
	report(fmt.Sprintf("after %d, no VACUUM", 2*n), "nov")
	vacuum()
	stat()
	report("after VACUUM", "")
	deliver()
	stat()
	report(fmt.Sprintf("%d more after the VACUUM", n), "end")
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(3*n), "ns/delivery")
	for unit, v := range sizes {
		b.ReportMetric(v, unit)
	}

	if sum := queryInt(b, sch.Pool, "SELECT sum(balance) FROM accounts"); sum != int64(3*n) {
		b.Fatalf("balances sum to %d, want %d", sum, 3*n)
	}
	if rows := queryInt(b, sch.Pool, "SELECT count(*) FROM "+store.Table()); rows != int64(3*n) {
		b.Fatalf("inbox rows %d, want %d", rows, 3*n)
	}
	if rows := queryInt(b, sch.Pool, "SELECT count(*) FROM "+store.AttemptsTable()); rows != 0 {
		b.Fatalf("attempts rows %d left, want 0", rows)
	}
	if rows := queryInt(b, sch.Pool, "SELECT count(*) FROM "+obCfg.MessagesTable()); rows != int64(3*n) {
		b.Fatalf("outbox rows %d, want %d", rows, 3*n)
	}
}
