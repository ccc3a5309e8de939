package router_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestBatchFromEnv: INBOX_BATCH_SIZE and INBOX_BATCH_LINGER set Config.Batch; bad values are
// refused naming the variable.
func TestBatchFromEnv(t *testing.T) {
	t.Setenv("INBOX_BROKER", "postgres")
	t.Setenv("INBOX_BATCH_SIZE", "16")
	t.Setenv("INBOX_BATCH_LINGER", "3ms")
	cfg, err := router.ConfigFromEnv()
	if err != nil || cfg.Batch.Size != 16 || cfg.Batch.Linger != 3*time.Millisecond {
		t.Fatalf("ConfigFromEnv = %+v, %v; want Batch{16, 3ms}", cfg.Batch, err)
	}
	for env, v := range map[string]string{"INBOX_BATCH_SIZE": "-1", "INBOX_BATCH_LINGER": "soon"} {
		t.Run(env, func(t *testing.T) {
			t.Setenv(env, v)
			if _, err := router.ConfigFromEnv(); !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), env) {
				t.Fatalf("ConfigFromEnv with %s=%q: %v, want ErrInvalidConfig naming it", env, v, err)
			}
		})
	}
}

// TestRouterBatch: with Config.Batch, NewInbox builds batched inboxes: on RabbitMQ with 4
// consumers of prefetch 1, eight payments commit in fewer transactions than messages, each
// applied once.
func TestRouterBatch(t *testing.T) {
	sch := testenv.NewSchema(t, 6)
	store := sch.Store(t)
	sch.Exec(t, "CREATE TABLE ledger (message_id text PRIMARY KEY, txid bigint NOT NULL)")
	cfg := router.Config{Broker: "amqp", URL: testenv.RequireAMQP(t), Settings: map[string]any{amqp.Name: &amqp.Config{Prefetch: 1, Consumers: 4}},
		Batch: inbox.BatchConfig{Size: 4, Linger: 100 * time.Millisecond}}
	r, err := router.New(cfg, sch.Pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ib, err := r.NewInbox(inbox.Config{Store: store, ConsumerName: "ledger-" + sch.Name}, nil)
	if err != nil {
		t.Fatal(err)
	}
	topic := "batch_" + sch.Name
	var mu sync.Mutex
	txs := map[int64]int{}
	if _, err := r.AddConsumer(ib, topic, func(msg *message.Message) error {
		tx, _ := pgstore.TxFromContext(msg.Context())
		var id int64
		if err := tx.QueryRow(msg.Context(), "INSERT INTO ledger VALUES ($1, txid_current()) RETURNING txid", msg.UUID).Scan(&id); err != nil {
			return err
		}
		mu.Lock()
		txs[id]++
		mu.Unlock()
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	for k := range 8 {
		if err := r.Broker.Publisher.Publish(topic, message.NewMessage(fmt.Sprintf("e-%d", k), []byte(`{}`))); err != nil {
			t.Fatal(err)
		}
	}
	go func() { _ = r.Run(context.Background()) }()
	<-r.Running()
	deadline := time.Now().Add(20 * time.Second)
	for ib.Stats().Processed < 8 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	var n int
	_ = sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM ledger").Scan(&n)
	mu.Lock()
	defer mu.Unlock()
	if n != 8 || ib.Stats().Processed != 8 || len(txs) >= 8 {
		t.Fatalf("ledger rows %d, stats %+v, %d transactions; want 8 rows in fewer than 8 transactions", n, ib.Stats(), len(txs))
	}
}
