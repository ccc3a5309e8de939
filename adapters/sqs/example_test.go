package sqs_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/config"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
)

// A round trip through a queue. Against AWS, leave OptFns empty; against a local
// SQS-compatible endpoint such as goaws, set its endpoint and the query protocol. (It compiles
// here; it runs, with its output checked, on goaws in the test module adapters/sqs/sqstest.)
func Example() {
	cfg, err := config.LoadDefaultConfig(context.Background()) // AWS_REGION, credentials...
	if err != nil {
		panic(err)
	}
	local := []func(*awssqs.Options){sqs.Endpoint("http://127.0.0.1:4100"), sqs.QueryProtocol}

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
}
