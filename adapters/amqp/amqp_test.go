package amqp_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/adaptertest"
	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

func harness(t testing.TB) adaptertest.Harness { return harnessWithConsumers(t, 0, 0) }

// harnessWithConsumers is harness with amqp.Config.Consumers n and Prefetch prefetch (0: the
// adapter's defaults): with n consumers of prefetch 1, a router handler has up to n
// deliveries in flight at once (with a larger prefetch, the first consumer to start can take
// them all, and watermill-amqp processes one at a time per consumer).
func harnessWithConsumers(t testing.TB, n, prefetch int) adaptertest.Harness {
	url := testenv.RequireAMQP(t)
	return adaptertest.Harness{
		NewBroker: func(_ *pgxpool.Pool, _ string) (*adapters.Broker, error) {
			// Queues expire 10 minutes after their last consumer leaves. The matrix publishes
			// before it subscribes: the publisher declares the default group's queue.
			return amqp.New(amqp.Config{URL: url, QueueArguments: map[string]any{"x-expires": int32(600000)}, DeclareGroups: []string{""}, Consumers: n, Prefetch: prefetch}, watermill.NopLogger{})
		},
	}
}

// concurrentHarness runs the crash child with 4 AMQP consumers of prefetch 1 on one handler
// (TestAdapterChildConcurrent).
func concurrentHarness(t testing.TB) adaptertest.Harness {
	h := harnessWithConsumers(t, 4, 1)
	h.ChildTest = "TestAdapterChildConcurrent"
	return h
}

func TestGuarantees(t *testing.T)   { adaptertest.Run(t, harness(t)) }
func TestAdapterChild(t *testing.T) { adaptertest.Child(t, harness(t)) }

// TestPoisonCrashLoop: a message that SIGKILLs its consumer inside the handler every time is
// dead-lettered after MaxAttempts or MaxAttempts + 1 runs, by the broker's own redeliveries:
// the adapter's redelivery signal never calls a redelivery a first delivery.
func TestPoisonCrashLoop(t *testing.T) { adaptertest.RunPoisonCrashLoop(t, harness(t)) }

// TestPoisonCrashLoopConcurrentConsumers: the same with 4 consumers on the handler, so the
// healthy payment published after the poison one is in flight beside it when it kills the
// child: crash isolation (docs/design.md) keeps the neighbour's crashes from dead-lettering it.
func TestPoisonCrashLoopConcurrentConsumers(t *testing.T) {
	adaptertest.RunPoisonCrashLoop(t, concurrentHarness(t))
}

// TestAdapterChildConcurrent is TestPoisonCrashLoopConcurrentConsumers's crash child.
func TestAdapterChildConcurrent(t *testing.T) { adaptertest.Child(t, concurrentHarness(t)) }

// BenchmarkRecoveryAfterSIGKILL: docs/operations.md's recovery figure
// (go test ./adapters/amqp -run '^$' -bench RecoveryAfterSIGKILL).
func BenchmarkRecoveryAfterSIGKILL(b *testing.B) { adaptertest.BenchmarkRecovery(b, harness(b)) }

// TestNonStringHeadersDoNotLoop publishes, with the plain AMQP client, a message carrying the
// header types RabbitMQ itself adds (x-death is a table array, x-delivery-count an integer).
// watermill-amqp's default unmarshaler fails on them and the message would be requeued forever;
// through the adapter it is delivered once, with its string headers as metadata.
func TestNonStringHeadersDoNotLoop(t *testing.T) {
	url := testenv.RequireAMQP(t)
	b, err := amqp.New(amqp.Config{URL: url, QueueArguments: map[string]any{"x-expires": int32(600000)}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	queue := fmt.Sprintf("headers_%d", time.Now().UnixNano())
	msgs, err := b.Subscriber.Subscribe(context.Background(), queue)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	err = ch.PublishWithContext(context.Background(), "", queue, false, false, amqp091.Publishing{
		Headers: amqp091.Table{
			"_watermill_message_uuid": "order-7",
			"name":                    "OrderPlaced",
			"x-delivery-count":        int64(3),
			"x-death":                 []any{amqp091.Table{"count": int64(1), "reason": "rejected", "queue": "orders"}},
		},
		Body: []byte(`{}`),
	})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		m.Ack()
		if m.UUID != "order-7" || m.Metadata.Get("name") != "OrderPlaced" {
			t.Fatalf("message %q metadata %v", m.UUID, m.Metadata)
		}
		if m.Metadata.Get("x-death") != "present" || m.Metadata.Get("x-delivery-count") != "3" {
			t.Fatalf("x-death %q, x-delivery-count %q; want \"present\" and \"3\"", m.Metadata.Get("x-death"), m.Metadata.Get("x-delivery-count"))
		}
		if r := b.Redelivery(m); r != inbox.Redelivered {
			t.Fatalf("a dead-lettered, counted message reads %v, want redelivered", r)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the message with non-string headers was never delivered")
	}
	select {
	case m := <-msgs:
		t.Fatalf("delivered again: %q (redelivered=%s)", m.UUID, m.Metadata.Get("_watermill_amqp_redelivered"))
	case <-time.After(500 * time.Millisecond):
	}
}

// TestPublishDeclaresTheQueue publishes to a topic nobody subscribed to yet: with the default
// group in DeclareGroups the publisher declares and binds its queue first, so a subscriber
// that comes later gets it.
func TestPublishDeclaresTheQueue(t *testing.T) {
	url := testenv.RequireAMQP(t)
	b, err := amqp.New(amqp.Config{URL: url, QueueArguments: map[string]any{"x-expires": int32(600000)}, DeclareGroups: []string{""}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	queue := fmt.Sprintf("late_%d", time.Now().UnixNano())
	if err := b.Publisher.Publish(queue, message.NewMessage("dead-letter-1", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	msgs, err := b.Subscriber.Subscribe(context.Background(), queue)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		m.Ack()
		if m.UUID != "dead-letter-1" {
			t.Fatalf("got %q", m.UUID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a message published before the first subscriber was lost")
	}
}

// TestUnroutedIsKept publishes to a topic no consumer group's queue is bound to yet: RabbitMQ
// would drop it; the topic exchange's alternate exchange keeps it in the unrouted queue. A
// group that subscribes later does not receive it (RabbitMQ keeps no log).
func TestUnroutedIsKept(t *testing.T) {
	url := testenv.RequireAMQP(t)
	unrouted := fmt.Sprintf("unrouted_%d", time.Now().UnixNano())
	b, err := amqp.New(amqp.Config{URL: url, UnroutedQueue: unrouted, QueueArguments: map[string]any{"x-expires": int32(600000)}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	topic := fmt.Sprintf("nobody_%d", time.Now().UnixNano())
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = ch.QueueDelete(unrouted, false, false, false)
		_ = ch.ExchangeDelete(unrouted, false, false)
		_, _ = ch.QueueDelete(amqp.QueueName(topic, "late"), false, false, false)
		_ = ch.ExchangeDelete(topic, false, false)
	})
	if err := b.Publisher.Publish(topic, message.NewMessage("early-1", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclarePassive(unrouted, true, false, false, false, nil)
	if err != nil || q.Messages != 1 {
		t.Fatalf("unrouted queue %q: %+v, %v; want 1 message", unrouted, q, err)
	}
	late, err := b.NewSubscriber("late")
	if err != nil {
		t.Fatal(err)
	}
	defer late.Close()
	msgs, err := late.Subscribe(context.Background(), topic)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Publisher.Publish(topic, message.NewMessage("after-1", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		m.Ack()
		if m.UUID != "after-1" {
			t.Fatalf("the late group got %q, want only after-1", m.UUID)
		}
		if r := b.Redelivery(m); r != inbox.FirstDelivery {
			t.Fatalf("first delivery reads %v", r)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the late group got nothing")
	}
}

// BenchmarkInboxVsBare: go test ./adapters/amqp -run '^$' -bench . -benchtime 2000x
func BenchmarkInboxVsBare(b *testing.B) {
	url := testenv.DefaultAMQPURL
	if v := testenv.AMQPURL(); v != "" {
		url = v
	}
	adaptertest.Benchmark(b, adaptertest.Harness{
		NewBroker: func(_ *pgxpool.Pool, _ string) (*adapters.Broker, error) {
			return amqp.New(amqp.Config{URL: url, QueueArguments: map[string]any{"x-expires": int32(600000)}, DeclareGroups: []string{""}}, watermill.NopLogger{})
		},
	}, 8)
}
