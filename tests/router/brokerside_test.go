package router_test

import (
	"errors"
	"strings"
	"testing"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"

	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka"
	"github.com/watermill-inbox/watermill-inbox/adapters/nats"
	"github.com/watermill-inbox/watermill-inbox/adapters/postgres"
	"github.com/watermill-inbox/watermill-inbox/adapters/redis"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// TestEveryAdapterFieldRefusedWithoutMap: every field an adapter documents as broker-side is
// refused by inbox.MetadataKey with no map passed, in any letter case.
func TestEveryAdapterFieldRefusedWithoutMap(t *testing.T) {
	tables := map[string]map[string]string{
		amqp.Name: amqp.BrokerSideFields, kafka.Name: kafka.BrokerSideFields, sqs.Name: sqs.BrokerSideFields,
		nats.Name: nats.BrokerSideFields, redis.Name: redis.BrokerSideFields, postgres.Name: postgres.BrokerSideFields,
	}
	n := 0
	for broker, fields := range tables {
		for field := range fields {
			for _, f := range []string{field, strings.ToUpper(field), strings.ToLower(field)} {
				if _, err := inbox.MetadataKey(f); !errors.Is(err, inbox.ErrBrokerSideKey) {
					t.Errorf("%s: MetadataKey(%q) = %v, want ErrBrokerSideKey", broker, f, err)
				}
			}
			n++
		}
	}
	for _, f := range []string{"partition_offset", "times_delivered", wamqp.MetadataRedeliveredKey, nats.NumDeliveredKey, sqs.ReceiveCountKey, sqs.SequenceNumberKey} {
		if _, err := inbox.MetadataKey(f); !errors.Is(err, inbox.ErrBrokerSideKey) {
			t.Errorf("MetadataKey(%q) = %v, want ErrBrokerSideKey", f, err)
		}
	}
	// The fields the adapters write into metadata are removed from dead letters.
	for _, f := range []string{wamqp.MetadataRedeliveredKey, "x-delivery-count", "x-death", nats.NumDeliveredKey, sqs.ReceiveCountKey, sqs.SequenceNumberKey} {
		if !brokerside.IsDeliveryState(f) {
			t.Errorf("IsBrokerSideField(%q) = false", f)
		}
	}
	if _, err := inbox.MetadataKey("order_id"); err != nil {
		t.Fatalf("a business field: %v", err)
	}
	t.Logf("%d broker-side fields refused", n)
}
