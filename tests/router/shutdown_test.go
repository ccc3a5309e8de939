package router_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/adapters/kafka"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkatest"
	"github.com/watermill-inbox/watermill-inbox/internal/routertest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestShutdownMidHandlerIsNotAnAttempt: a rolling deploy on a real broker. Dead letters on,
// MaxAttempts 2; the handler writes with msg.Context() after a pause. The router is closed
// while the handler runs, twice (Router.Close cancels the message contexts), then a third
// router processes the message. It is applied once and never dead-lettered, on RabbitMQ,
// Kafka (kfake) and the postgres broker; and the attempts table is empty afterwards.
func TestShutdownMidHandlerIsNotAnAttempt(t *testing.T) {
	kafkaCluster := kafkatest.NewCluster(t)
	for _, cfg := range []router.Config{
		{Broker: "amqp", URL: testenv.RequireAMQP(t)},
		{Broker: "kafka", URL: "kafka://" + strings.Join(kafkaCluster.Addrs(), ","), Settings: map[string]any{kafka.Name: &kafka.Config{
			SessionTimeout: time.Second, HeartbeatInterval: 100 * time.Millisecond, RebalanceTimeout: 5 * time.Second,
			FetchMaxWait: 50 * time.Millisecond, CommitInterval: 100 * time.Millisecond,
		}}},
		{Broker: "postgres"},
	} {
		t.Run(cfg.Broker, func(t *testing.T) {
			sch := testenv.NewSchema(t, 12)
			store := sch.Store(t)
			sch.CreateAccounts(t, 1)
			topic := "deploy_" + sch.Name
			cfg.ConsumerGroupPrefix = sch.Name + "_"
			t.Cleanup(func() { routertest.DeleteTopic(t, cfg, topic) })
			var deadLettered, skips uint64
			for life := 1; life <= 3; life++ {
				r, err := router.New(cfg, sch.Pool, nil)
				if err != nil {
					t.Fatal(err)
				}
				ib, err := r.NewInbox(inbox.Config{
					Store: store, ConsumerName: "billing", MaxAttempts: 2,
					DeadLetterPublisher: r.Broker.Publisher, DeadLetterTopic: topic + "_dead",
				}, nil)
				if err != nil {
					t.Fatal(err)
				}
				started := make(chan struct{}, 10)
				pause := 3 * time.Second
				if life == 3 {
					pause = 0
				}
				if _, err := r.AddConsumer(ib, topic, func(msg *message.Message) error {
					started <- struct{}{}
					select {
					case <-time.After(pause):
					case <-msg.Context().Done():
					}
					tx, _ := pgstore.TxFromContext(msg.Context())
					_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 7 WHERE id = 1")
					return err
				}); err != nil {
					t.Fatal(err)
				}
				running := testenv.RunRouter(t, r.Router)
				if life == 1 {
					if err := r.Broker.Publisher.Publish(topic, message.NewMessage("pay-deploy", []byte(`{}`))); err != nil {
						t.Fatal(err)
					}
				}
				select {
				case <-started:
				case <-time.After(30 * time.Second):
					t.Fatalf("life %d: the message was not delivered", life)
				}
				if life < 3 {
					// The rolling deploy: close while the handler waits.
					if err := running.Close(); err != nil {
						t.Logf("life %d: router close: %v", life, err)
					}
				} else {
					deadline := time.Now().Add(20 * time.Second)
					for ib.Stats().Processed == 0 && time.Now().Before(deadline) {
						time.Sleep(20 * time.Millisecond)
					}
					_ = running.Close()
				}
				_ = r.Close()
				s := ib.Stats()
				deadLettered += s.DeadLettered
				skips += s.DeadLetteredSkips
			}
			var balance int64
			var attempts int
			ctx := context.Background()
			if err := sch.Pool.QueryRow(ctx, "SELECT balance FROM accounts WHERE id = 1").Scan(&balance); err != nil {
				t.Fatal(err)
			}
			if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+store.AttemptsTable()).Scan(&attempts); err != nil {
				t.Fatal(err)
			}
			if balance != 7 || deadLettered != 0 || skips != 0 || attempts != 0 {
				t.Fatalf("balance %d, dead-lettered %d, dead-lettered skips %d, attempt rows %d; want 7, 0, 0, 0", balance, deadLettered, skips, attempts)
			}
		})
	}
}
