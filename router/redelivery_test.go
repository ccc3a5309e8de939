package router_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestRedeliverySignalPerBroker reads Broker.Redelivery on a first delivery and on the
// redelivery after a Nack, on the real brokers. Where a broker has no trustworthy signal the
// adapter must say RedeliveryUnknown both times (docs/adapters.md): postgres re-sends a
// nacked message in process and exposes no count; kafka's first delivery of a record
// appended after its consumer was assigned the partition is FirstDelivery, redis's read with
// XREADGROUP too, and the in-process re-send after a nack of either is RedeliveryUnknown (a
// redis entry taken over with XCLAIM is Redelivered: TestPoisonCrashLoop in adapters/redis,
// TestRedeliveryMarksTravelWithTheEntry); goaws always reports an
// ApproximateReceiveCount of 1 on a standard queue, which the sqs adapter reads as unknown
// (SQS's Redelivered case is covered by TestSQSRedeliveryFromReceiveCount, not on goaws).
func TestRedeliverySignalPerBroker(t *testing.T) {
	want := map[string][2]inbox.Redelivery{
		"postgres": {inbox.RedeliveryUnknown, inbox.RedeliveryUnknown},
		"amqp":     {inbox.FirstDelivery, inbox.Redelivered},
		"kafka":    {inbox.FirstDelivery, inbox.RedeliveryUnknown},
		"sqs":      {inbox.RedeliveryUnknown, inbox.RedeliveryUnknown},
		"nats":     {inbox.FirstDelivery, inbox.Redelivered},
		"redis":    {inbox.FirstDelivery, inbox.RedeliveryUnknown},
	}
	for _, cfg := range brokerConfigs(t) {
		t.Run(cfg.Broker, func(t *testing.T) {
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
			t.Cleanup(func() { deleteTopic(t, cfg, topic); deleteAMQP(t, cfg, topic, "probe") })
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
			if got != want[cfg.Broker] {
				t.Fatalf("first, redelivered = %v, %v; want %v, %v", got[0], got[1], want[cfg.Broker][0], want[cfg.Broker][1])
			}
		})
	}
}

// TestSQSRedeliveryFromReceiveCount covers what goaws cannot produce: a receive count above 1,
// and a FIFO queue's first receive.
func TestSQSRedeliveryFromReceiveCount(t *testing.T) {
	for _, c := range []struct {
		count, seq string
		want       inbox.Redelivery
	}{
		{"", "", inbox.RedeliveryUnknown},
		{"x", "", inbox.RedeliveryUnknown},
		{"1", "", inbox.RedeliveryUnknown}, // a standard queue may hand out a second copy
		{"1", "18849496460467696128", inbox.FirstDelivery},
		{"2", "", inbox.Redelivered},
		{"3", "18849496460467696128", inbox.Redelivered},
	} {
		m := message.NewMessage("m", nil)
		if c.count != "" {
			m.Metadata.Set(sqs.ReceiveCountKey, c.count)
		}
		if c.seq != "" {
			m.Metadata.Set(sqs.SequenceNumberKey, c.seq)
		}
		if got := sqs.Redelivery(m); got != c.want {
			t.Errorf("count %q, sequence %q: %v, want %v", c.count, c.seq, got, c.want)
		}
	}
}
