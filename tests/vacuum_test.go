package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
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

// envMeasureVacuum opts in to TestTableChurnAndVacuum.
const envMeasureVacuum = "INBOX_MEASURE_VACUUM"

// TestTableChurnAndVacuum (opt-in: INBOX_MEASURE_VACUUM=1, or =N deliveries per round,
// default 20000) measures what a long run leaves in the tables that churn, with autovacuum off
// as on this project's machines: rounds of N healthy deliveries through an inbox with durable
// attempt counting (a dead-letter topic set) whose handler stores one receipt in the outbox,
// with and without an explicit VACUUM between rounds. It logs the size and dead tuples of the
// inbox, attempts and outbox tables, and asserts the business state: every payment applied
// once (the balances), N inbox rows per round, no attempts row left (a processed message's
// count is deleted), one outbox row per payment. docs/operations.md records the figures.
//
//	INBOX_MEASURE_VACUUM=20000 go test ./tests -run TestTableChurnAndVacuum -v -timeout 20m
func TestTableChurnAndVacuum(t *testing.T) {
	n := 20000
	switch v := os.Getenv(envMeasureVacuum); v {
	case "":
		t.Skipf("set %s=1 (or a number of deliveries per round) to measure", envMeasureVacuum)
	case "1":
	default:
		if _, err := fmt.Sscan(v, &n); err != nil || n < 100 {
			t.Fatalf("%s=%q: want 1 or a number of deliveries >= 100", envMeasureVacuum, v)
		}
	}
	sch := testenv.NewSchema(t, 10)
	store := setupBank(t, sch, 100)
	obCfg := outbox.Config{}
	if err := outbox.InitializeSchema(context.Background(), sch.Pool, obCfg); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(obCfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	dead := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: bankConsumerName, Outbox: ob,
		DeadLetterPublisher: dead, DeadLetterTopic: "dead"}, nil)
	if err != nil {
		t.Fatal(err)
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
	report := func(when string) {
		for _, name := range []string{"inbox", "attempts", "outbox"} {
			var size, dead, live int64
			err := sch.Pool.QueryRow(context.Background(), `SELECT pg_total_relation_size($1::regclass),
				coalesce((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = $1::regclass), 0),
				coalesce((SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = $1::regclass), 0)`, tables[name]).Scan(&size, &dead, &live)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("CHURN %-32s %-8s %7.2f MB, live %7d, dead %7d", when, name, float64(size)/1e6, live, dead)
		}
	}
	round := 0
	deliver := func() {
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for w := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := w; i < n; i += 8 {
					m := paymentMsg(t, fmt.Sprintf("r%d-%d", round, i), i%100+1, 1)
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
			t.Fatal(err)
		default:
		}
		round++
	}
	vacuum := func() {
		for _, name := range []string{"inbox", "attempts", "outbox"} {
			if _, err := sch.Pool.Exec(context.Background(), "VACUUM "+tables[name]); err != nil {
				t.Fatal(err)
			}
		}
	}
	stat := func() { _, _ = sch.Pool.Exec(context.Background(), "SELECT pg_stat_force_next_flush()") }

	deliver()
	stat()
	report(fmt.Sprintf("after %d deliveries", n))
	deliver()
	stat()
	report(fmt.Sprintf("after %d, no VACUUM", 2*n))
	vacuum()
	stat()
	report("after VACUUM")
	deliver()
	stat()
	report(fmt.Sprintf("%d more after the VACUUM", n))

	if sum := queryInt(t, sch.Pool, "SELECT sum(balance) FROM accounts"); sum != int64(3*n) {
		t.Fatalf("balances sum to %d, want %d", sum, 3*n)
	}
	if rows := queryInt(t, sch.Pool, "SELECT count(*) FROM "+store.Table()); rows != int64(3*n) {
		t.Fatalf("inbox rows %d, want %d", rows, 3*n)
	}
	if rows := queryInt(t, sch.Pool, "SELECT count(*) FROM "+store.AttemptsTable()); rows != 0 {
		t.Fatalf("attempts rows %d left, want 0", rows)
	}
	if rows := queryInt(t, sch.Pool, "SELECT count(*) FROM "+obCfg.MessagesTable()); rows != int64(3*n) {
		t.Fatalf("outbox rows %d, want %d", rows, 3*n)
	}
}
