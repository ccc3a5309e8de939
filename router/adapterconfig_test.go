package router_test

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
	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestAdapterSettingsReachTheAdapter: Config.SQS's AWS configuration replaces the SDK's
// default resolution (no AWS_* environment here), and its queue attributes and subscriber
// settings reach the adapter, next to the URL and SQSQueryProtocol.
func TestAdapterSettingsReachTheAdapter(t *testing.T) {
	b, err := router.NewBroker(router.Config{
		Broker: "sqs", URL: sqstest.Endpoint(), SQSQueryProtocol: true,
		SQS: &sqs.BrokerConfig{
			AWSConfig:       sqstest.AWSConfig(),
			QueueAttributes: map[string]string{"VisibilityTimeout": "7"},
			WaitTime:        time.Second,
		},
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
		t.Errorf("queue VisibilityTimeout = %q, want 7 (from Config.SQS.QueueAttributes)", got)
	}
	_, _ = client.DeleteQueue(ctx, &awssqs.DeleteQueueInput{QueueUrl: u.QueueUrl})
}
