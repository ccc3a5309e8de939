package sqstest_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs/sqstest"
	"github.com/watermill-inbox/watermill-inbox/internal/routertest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// The router on sqs, on goaws: the cases of package internal/routertest that tests/router runs
// on the other brokers.

func sqsConfig(t *testing.T) router.Config {
	sqstest.SetAWSEnv(t) // region and credentials for the AWS SDK's default resolution
	return router.Config{Broker: sqs.Name, URL: sqstest.Endpoint(), SQSQueryProtocol: true}
}

func TestRouterSameHandler(t *testing.T) { routertest.SameHandler(t, sqsConfig(t)) }

// TestRouterFanOut: a second consumer name of one topic is refused with adapters.ErrNoFanOut;
// two instances of one consumer name share the topic's queue.
func TestRouterFanOut(t *testing.T) { routertest.FanOutPerConsumerName(t, sqsConfig(t)) }

// TestRouterRedeliverySignal: goaws always reports an ApproximateReceiveCount of 1 on a
// standard queue, which the adapter reads as unknown (SQS's Redelivered case is covered by
// TestSQSRedeliveryFromReceiveCount in tests/router, not on goaws).
func TestRouterRedeliverySignal(t *testing.T) {
	routertest.RedeliverySignal(t, sqsConfig(t), [2]inbox.Redelivery{inbox.RedeliveryUnknown, inbox.RedeliveryUnknown})
}

// TestAdapterSettingsReachTheAdapter: Config.Settings' AWS configuration replaces the SDK's
// default resolution (no AWS_* environment here), and its queue attributes and subscriber
// settings reach the adapter, next to the URL and SQSQueryProtocol.
func TestAdapterSettingsReachTheAdapter(t *testing.T) {
	b, err := router.NewBroker(router.Config{
		Broker: "sqs", URL: sqstest.Endpoint(), SQSQueryProtocol: true,
		Settings: map[string]any{sqs.Name: &sqs.BrokerConfig{
			AWSConfig:       sqstest.AWSConfig(),
			QueueAttributes: map[string]string{"VisibilityTimeout": "7"},
			WaitTime:        time.Second,
		}},
	}, nil, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	topic := fmt.Sprintf("adaptercfg_%d", time.Now().UnixNano())
	if err := b.Publisher.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("x"))); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	client := sqstest.Client()
	u, err := client.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(topic)})
	if err != nil {
		t.Fatal(err)
	}
	attrs, err := client.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{
		QueueUrl: u.QueueUrl, AttributeNames: []sqstypes.QueueAttributeName{sqstypes.QueueAttributeNameVisibilityTimeout},
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := attrs.Attributes["VisibilityTimeout"]; got != "7" {
		t.Errorf("queue VisibilityTimeout = %q, want 7 (from the settings' QueueAttributes)", got)
	}
	_, _ = client.DeleteQueue(ctx, &awssqs.DeleteQueueInput{QueueUrl: u.QueueUrl})
}
