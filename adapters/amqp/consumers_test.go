package amqp_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

// TestConsumersDeliverConcurrently: with Consumers 3 and Prefetch 1, one Subscribe hands out
// three messages before any of them is acked (one consumer alone would wait for each ack), and
// the publisher with a channel pool publishes them.
func TestConsumersDeliverConcurrently(t *testing.T) {
	url := testenv.RequireAMQP(t)
	b, err := amqp.New(amqp.Config{
		URL: url, Prefetch: 1, Consumers: 3, PublishChannelPoolSize: 2,
		QueueArguments: map[string]any{"x-expires": int32(600000)},
	}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	queue := fmt.Sprintf("consumers_%d", time.Now().UnixNano())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	msgs, err := b.Subscriber.Subscribe(ctx, queue)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := b.Publisher.Publish(queue, message.NewMessage(fmt.Sprint(i), []byte("x"))); err != nil {
			t.Fatal(err)
		}
	}
	var held []*message.Message
	for len(held) < 3 {
		select {
		case msg := <-msgs:
			held = append(held, msg) // not acked yet
		case <-ctx.Done():
			t.Fatalf("%d of 3 messages delivered before any ack, want 3", len(held))
		}
	}
	for _, msg := range held {
		msg.Ack()
	}
	cancel()
	for range msgs { // the merged channel closes once every consumer stopped
	}
}
