// Package routertest holds the cross-broker test cases of package router, each run on one
// broker configuration: tests/router runs them on the machine's services and an in-process
// Kafka, the test module adapters/sqs/sqstest on goaws (an SQS emulator the root module does
// not require). Test support only.
package routertest

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	goredis "github.com/redis/go-redis/v9"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// SameHandler runs one handler, unchanged, on the broker cfg names: only the Config differs
// between brokers. Three publishes (one a duplicate ID) must give two ledger rows.
func SameHandler(t *testing.T, cfg router.Config) {
	sch := testenv.NewSchema(t, 8)
	ctx := context.Background()
	store := sch.Store(t)
	sch.Exec(t, "CREATE TABLE ledger (message_id text PRIMARY KEY)")
	r, err := router.New(cfg, sch.Pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "ledger", BrokerSideFields: r.Broker.BrokerSideFields}, nil)
	if err != nil {
		t.Fatal(err)
	}
	topic := "entries_" + sch.Name
	t.Cleanup(func() { DeleteTopic(t, cfg, topic) })
	_, err = r.AddConsumer(ib, topic, func(msg *message.Message) error { // the handler, identical on every broker
		tx, _ := pgstore.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "INSERT INTO ledger VALUES ($1)", msg.UUID)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = r.Run(ctx) }()
	<-r.Running()
	for _, id := range []string{"e-1", "e-2", "e-1"} {
		if err := r.Broker.Publisher.Publish(topic, message.NewMessage(id, []byte(`{}`))); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for ib.Stats().Processed+ib.Stats().Duplicates < 3 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	var n int
	_ = sch.Pool.QueryRow(ctx, "SELECT count(*) FROM ledger").Scan(&n)
	if s := ib.Stats(); n != 2 || s.Processed != 2 || s.Duplicates != 1 {
		t.Fatalf("ledger rows %d, stats %+v; want 2 rows, 2 processed, 1 duplicate", n, s)
	}
}

// FanOutPerConsumerName: consumers "shipping" and "analytics" of one topic each process
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
func FanOutPerConsumerName(t *testing.T, cfg router.Config) {
	const n = 40
	sch := testenv.NewSchema(t, 24)
	store := sch.Store(t)
	sch.Exec(t, "CREATE TABLE handled (consumer text NOT NULL, instance text NOT NULL, message_id text NOT NULL)")
	topic := "orders_" + sch.Name
	t.Cleanup(func() {
		DeleteTopic(t, cfg, topic)
		DeleteAMQP(t, cfg, topic, "shipping", "analytics", router.DefaultConsumerGroup)
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
}

// RedeliverySignal reads Broker.Redelivery on a first delivery and on the redelivery after a
// Nack, and wants want (first, redelivered). Where a broker has no trustworthy signal the
// adapter must say RedeliveryUnknown both times (docs/adapters.md). On sqs it also checks
// goaws's receive count, which is always 1.
func RedeliverySignal(t *testing.T, cfg router.Config, want [2]inbox.Redelivery) {
	sch := testenv.NewSchema(t, 8)
	b, err := router.NewBroker(cfg, sch.Pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if b.Redelivery == nil {
		t.Fatal("Broker.Redelivery is nil")
	}
	topic := "redeliver_" + sch.Name
	t.Cleanup(func() { DeleteTopic(t, cfg, topic); DeleteAMQP(t, cfg, topic, "probe") })
	sub := b.Subscriber
	if b.NewSubscriber != nil {
		if sub, err = b.SubscriberFor("probe"); err != nil {
			t.Fatal(err)
		}
		defer sub.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Broker == "kafka" {
		// Kafka: only a record appended after the session read the partitions' high
		// watermarks (in its Setup, before any record is delivered) is a first
		// delivery. One delivered record shows the session is there.
		if err := b.Publisher.Publish(topic, message.NewMessage("warm-up", []byte(`{}`))); err != nil {
			t.Fatal(err)
		}
		select {
		case m := <-msgs:
			m.Ack()
		case <-ctx.Done():
			t.Fatal("warm-up never came")
		}
	}
	if err := b.Publisher.Publish(topic, message.NewMessage("m-1", []byte(`{}`))); err != nil {
		t.Fatal(err)
	}
	var got [2]inbox.Redelivery
	for i := range got {
		select {
		case m := <-msgs:
			if m.UUID != "m-1" {
				t.Fatalf("delivery %d: message %q", i+1, m.UUID)
			}
			got[i] = b.Redelivery(m)
			if cfg.Broker == "sqs" && m.Metadata.Get(sqs.ReceiveCountKey) != "1" {
				t.Errorf("goaws receive count %q, want \"1\" (it always reports 1)", m.Metadata.Get(sqs.ReceiveCountKey))
			}
			if i == 0 {
				m.Nack()
			} else {
				m.Ack()
			}
		case <-ctx.Done():
			t.Fatalf("delivery %d never came", i+1)
		}
	}
	if got != want {
		t.Fatalf("first, redelivered = %v, %v; want %v, %v", got[0], got[1], want[0], want[1])
	}
}

// DeleteTopic removes the stream a NATS or Redis run left on the server (RabbitMQ's queue is
// auto-deleted with its consumer; PostgreSQL's tables go with the schema).
func DeleteTopic(t *testing.T, cfg router.Config, topic string) {
	switch cfg.Broker {
	case "nats":
		nc, err := natsgo.Connect(cfg.URL)
		if err != nil {
			t.Logf("cleanup: %v", err)
			return
		}
		defer nc.Close()
		if js, err := nc.JetStream(); err == nil {
			_ = js.DeleteStream(topic)
		}
	case "redis":
		opts, err := goredis.ParseURL(cfg.URL)
		if err != nil {
			return
		}
		c := goredis.NewClient(opts)
		defer c.Close()
		_ = c.Del(context.Background(), topic).Err()
	}
}

// DeleteAMQP deletes the exchange and the consumer groups' queues an amqp run left.
func DeleteAMQP(t *testing.T, cfg router.Config, topic string, groups ...string) {
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
