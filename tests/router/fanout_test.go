package router_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkatest"
	"github.com/watermill-inbox/watermill-inbox/internal/routertest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// brokerConfigs are the brokers of the machine's services and an in-process Kafka. sqs runs
// on goaws, which the root module does not require: its cases run in the test module
// adapters/sqs/sqstest.
func brokerConfigs(t *testing.T) []router.Config {
	kafkaCluster := kafkatest.NewCluster(t)
	return []router.Config{
		{Broker: "postgres"},
		{Broker: "amqp", URL: testenv.RequireAMQP(t)},
		{Broker: "kafka", URL: "kafka://" + strings.Join(kafkaCluster.Addrs(), ",")},
		{Broker: "nats", URL: testenv.RequireNATS(t)},
		{Broker: "redis", URL: testenv.RequireRedis(t)},
	}
}

// TestFanOutPerConsumerName: each consumer name gets every message, the instances of one
// share them (routertest.FanOutPerConsumerName).
func TestFanOutPerConsumerName(t *testing.T) {
	for _, cfg := range brokerConfigs(t) {
		t.Run(cfg.Broker, func(t *testing.T) { routertest.FanOutPerConsumerName(t, cfg) })
	}
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
