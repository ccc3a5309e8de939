package router_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkatest"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs/sqstest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// brokerConfigs are the six brokers, on the machine's services (kafka and sqs in process).
func brokerConfigs(t *testing.T) []router.Config {
	sqstest.SetAWSEnv(t)
	kafkaCluster := kafkatest.NewCluster(t)
	return []router.Config{
		{Broker: "postgres"},
		{Broker: "amqp", URL: testenv.RequireAMQP(t)},
		{Broker: "kafka", URL: "kafka://" + strings.Join(kafkaCluster.Addrs(), ",")},
		{Broker: "sqs", URL: sqstest.Endpoint(), SQSQueryProtocol: true},
		{Broker: "nats", URL: testenv.RequireNATS(t)},
		{Broker: "redis", URL: testenv.RequireRedis(t)},
	}
}

// TestFanOutPerConsumerName: consumers "shipping" and "analytics" of one topic each process
// every message exactly once (rows per consumer in the business table), while two instances of
// "shipping" (two routers, as two processes would be) share its messages. A first batch is
// published before any consumer subscribed (before the routers exist, except on amqp, see
// below), a second after AddConsumer and before Run, the rest while running.
//
// amqp keeps no log: a message published while no queue is bound to the topic is kept in the
// unrouted queue, not delivered to a group that binds later (TestUnroutedIsKept in
// adapters/amqp); the group's queue exists from AddConsumer on. sqs has no fan-out: the
// second consumer name is refused with adapters.ErrNoFanOut, and only the competing instances
// are tested.
func TestFanOutPerConsumerName(t *testing.T) {
	const n = 40
	for _, cfg := range brokerConfigs(t) {
		t.Run(cfg.Broker, func(t *testing.T) {
			sch := testenv.NewSchema(t, 24)
			store := sch.Store(t)
			sch.Exec(t, "CREATE TABLE handled (consumer text NOT NULL, instance text NOT NULL, message_id text NOT NULL)")
			topic := "orders_" + sch.Name
			t.Cleanup(func() {
				deleteTopic(t, cfg, topic)
				deleteAMQP(t, cfg, topic, "shipping", "analytics", router.DefaultConsumerGroup)
			})

			publish := func(pub message.Publisher, from, to int) {
				t.Helper()
				for i := from; i < to; i++ {
					if err := pub.Publish(topic, message.NewMessage(fmt.Sprintf("order-%d", i), []byte(`{}`))); err != nil {
						t.Fatal(err)
					}
				}
			}
			next := 0
			if cfg.Broker != "amqp" { // before any consumer subscribed
				b, err := router.NewBroker(cfg, sch.Pool, nil)
				if err != nil {
					t.Fatal(err)
				}
				publish(b.Publisher, 0, 10)
				_ = b.Close()
				next = 10
			}

			newConsumer := func(r *router.Router, name, instance string) (*inbox.Inbox, error) {
				ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: name, BrokerSideFields: r.Broker.BrokerSideFields}, nil)
				if err != nil {
					t.Fatal(err)
				}
				_, err = r.AddConsumer(ib, topic, func(msg *message.Message) error {
					tx, _ := pgstore.TxFromContext(msg.Context())
					_, err := tx.Exec(msg.Context(), "INSERT INTO handled VALUES ($1, $2, $3)", name, instance, msg.UUID)
					return err
				})
				return ib, err
			}
			ra, err := router.New(cfg, sch.Pool, nil)
			if err != nil {
				t.Fatal(err)
			}
			rb, err := router.New(cfg, sch.Pool, nil)
			if err != nil {
				t.Fatal(err)
			}
			shipA, err := newConsumer(ra, "shipping", "a")
			if err != nil {
				t.Fatal(err)
			}
			shipB, err := newConsumer(rb, "shipping", "b")
			if err != nil {
				t.Fatal(err)
			}
			consumers := []string{"shipping"}
			_, err = newConsumer(ra, "analytics", "a")
			if cfg.Broker == "sqs" {
				if !errors.Is(err, adapters.ErrNoFanOut) {
					t.Fatalf("second consumer name on sqs: %v, want adapters.ErrNoFanOut", err)
				}
			} else if err != nil {
				t.Fatal(err)
			} else {
				consumers = append(consumers, "analytics")
			}
			publish(ra.Broker.Publisher, next, 20) // after AddConsumer, before Run
			testenv.RunRouter(t, ra.Router)
			testenv.RunRouter(t, rb.Router)
			t.Cleanup(func() { _ = ra.Close(); _ = rb.Close() })
			publish(ra.Broker.Publisher, 20, n)

			count := func(consumer string) (rows, distinct int) {
				_ = sch.Pool.QueryRow(context.Background(),
					"SELECT count(*), count(DISTINCT message_id) FROM handled WHERE consumer = $1", consumer).Scan(&rows, &distinct)
				return rows, distinct
			}
			deadline := time.Now().Add(60 * time.Second)
			for _, c := range consumers {
				for {
					if rows, _ := count(c); rows >= n || time.Now().After(deadline) {
						break
					}
					time.Sleep(50 * time.Millisecond)
				}
			}
			time.Sleep(500 * time.Millisecond) // a late duplicate would show now
			for _, c := range consumers {
				if rows, distinct := count(c); rows != n || distinct != n {
					t.Errorf("consumer %s: %d rows, %d distinct messages; want %d and %d", c, rows, distinct, n, n)
				}
			}
			var a, b int
			_ = sch.Pool.QueryRow(context.Background(),
				"SELECT count(*) FILTER (WHERE instance = 'a'), count(*) FILTER (WHERE instance = 'b') FROM handled WHERE consumer = 'shipping'").Scan(&a, &b)
			dups := shipA.Stats().Duplicates + shipB.Stats().Duplicates
			t.Logf("shipping instances: a processed %d, b processed %d, duplicates skipped %d", a, b, dups)
			if dups >= n/4 { // each instance receiving every message would give n duplicates
				t.Errorf("the two shipping instances skipped %d duplicates of %d messages: they do not share one consumer group", dups, n)
			}
		})
	}
}

// deleteAMQP deletes the exchange and the consumer groups' queues an amqp run left.
func deleteAMQP(t *testing.T, cfg router.Config, topic string, groups ...string) {
	if cfg.Broker != "amqp" {
		return
	}
	conn, err := amqp091.Dial(cfg.URL)
	if err != nil {
		t.Logf("cleanup: %v", err)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	for _, g := range groups {
		_, _ = ch.QueueDelete(amqp.QueueName(topic, g), false, false, false)
	}
	_, _ = ch.QueueDelete(topic, false, false, false)
	_ = ch.ExchangeDelete(topic, false, false)
}

// TestRetryAddedAfterAddConsumerStaysOutside: a router-level Retry added after AddConsumer
// must still run outside the inbox, so each attempt is a transaction of its own. The handler
// credits 100 and fails on its first run: the balance must be 100 (200 if Retry re-ran the
// handler inside the first attempt's transaction).
func TestRetryAddedAfterAddConsumerStaysOutside(t *testing.T) {
	sch := testenv.NewSchema(t, 8)
	store := sch.Store(t)
	sch.CreateAccounts(t, 1)
	r, err := router.New(router.Config{Broker: "postgres"}, sch.Pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	topic := "payments_" + sch.Name
	if _, err := r.AddConsumer(ib, topic, func(msg *message.Message) error {
		tx, _ := pgstore.TxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 100 WHERE id = 1"); err != nil {
			return err
		}
		if runs.Add(1) == 1 {
			return errors.New("transient failure after the credit")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(wmmiddleware.Retry{MaxRetries: 3, InitialInterval: 10 * time.Millisecond}.Middleware) // after AddConsumer
	testenv.RunRouter(t, r.Router)
	t.Cleanup(func() { _ = r.Close() })
	if err := r.Broker.Publisher.Publish(topic, message.NewMessage("pay-1", []byte(`{}`))); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for ib.Stats().Processed < 1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	var balance int64
	_ = sch.Pool.QueryRow(context.Background(), "SELECT balance FROM accounts WHERE id = 1").Scan(&balance)
	if balance != 100 || runs.Load() != 2 {
		t.Fatalf("balance %d after %d handler runs; want 100 after 2", balance, runs.Load())
	}
}
