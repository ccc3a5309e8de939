package sqstest_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
)

// A round trip through a queue. Against AWS, build the aws.Config with
// config.LoadDefaultConfig(ctx) and leave OptFns empty; here it points at the in-process
// goaws of the tests (goawsOptions sets its endpoint and the query protocol).
func Example_roundTrip() {
	cfg := awsConfig() // in production: cfg, err := config.LoadDefaultConfig(ctx)
	local := []func(*awssqs.Options){goawsOptions}

	pub, err := sqs.NewPublisher(sqs.PublisherConfig{AWSConfig: cfg, OptFns: local}, nil)
	if err != nil {
		panic(err)
	}
	defer pub.Close()
	sub, err := sqs.NewSubscriber(sqs.SubscriberConfig{
		AWSConfig: cfg,
		OptFns:    local,
		WaitTime:  time.Second, // long polling; the default is the SQS maximum, 20 s
	}, nil)
	if err != nil {
		panic(err)
	}
	defer sub.Close()

	topic := "example-payments-" + watermill.NewShortUUID()
	if err := sub.SubscribeInitialize(topic); err != nil { // CreateQueue
		panic(err)
	}
	sent := message.NewMessage(watermill.NewUUID(), []byte(`{"amount":5}`))
	sent.Metadata.Set("payment_request_id", "pr-42")
	if err := pub.Publish(topic, sent); err != nil {
		panic(err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	messages, err := sub.Subscribe(ctx, topic)
	if err != nil {
		panic(err)
	}
	msg := <-messages
	fmt.Println(string(msg.Payload), msg.Metadata.Get("payment_request_id"), msg.UUID == sent.UUID)
	msg.Ack() // DeleteMessage
	// Output: {"amount":5} pr-42 true
}
