package router_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/internal/routertest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// TestRedeliverySignalPerBroker reads Broker.Redelivery on a first delivery and on the
// redelivery after a Nack, on the real brokers (routertest.RedeliverySignal). postgres
// re-sends a nacked message in process and exposes no count; kafka's first delivery of a
// record appended after its consumer was assigned the partition is FirstDelivery, redis's read
// with XREADGROUP too, and the in-process re-send after a nack of either is RedeliveryUnknown
// (a redis entry taken over with XCLAIM is Redelivered: TestPoisonCrashLoop in adapters/redis,
// TestRedeliveryMarksTravelWithTheEntry). sqs runs on goaws in the test module
// adapters/sqs/sqstest (its Redelivered case is covered by TestSQSRedeliveryFromReceiveCount).
func TestRedeliverySignalPerBroker(t *testing.T) {
	want := map[string][2]inbox.Redelivery{
		"postgres": {inbox.RedeliveryUnknown, inbox.RedeliveryUnknown},
		"amqp":     {inbox.FirstDelivery, inbox.Redelivered},
		"kafka":    {inbox.FirstDelivery, inbox.RedeliveryUnknown},
		"nats":     {inbox.FirstDelivery, inbox.Redelivered},
		"redis":    {inbox.FirstDelivery, inbox.RedeliveryUnknown},
	}
	for _, cfg := range brokerConfigs(t) {
		t.Run(cfg.Broker, func(t *testing.T) { routertest.RedeliverySignal(t, cfg, want[cfg.Broker]) })
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
