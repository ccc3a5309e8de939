package sqstest_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
)

// TestPubSub runs Watermill's universal Pub/Sub conformance suite against goaws.
func TestPubSub(t *testing.T) {
	features := tests.Features{
		// One SQS queue is one consumer group: every message goes to one of its consumers.
		// Fan-out to several groups needs SNS (one queue per group), which this adapter does not
		// do, so TestConsumerGroups is skipped by the suite.
		ConsumerGroups: false,
		// SQS delivers at least once.
		ExactlyOnceDelivery: false,
		// Standard queues do not keep order (goaws happens to, real SQS does not), so the
		// suite's order tests (TestPublishSubscribeInOrder, TestNoAck) are skipped. FIFO queues
		// do keep order per message group but are not what the suite runs on.
		GuaranteedOrder:                     false,
		GuaranteedOrderWithSingleSubscriber: false,
		// Messages stay in the queue across Subscriber instances.
		Persistent: true,
		// goaws runs inside the test binary: no command can restart it, so the suite skips
		// TestReconnect. TestReceiveSurvivesBrokerOutage (outage_test.go) covers reconnecting.
		RestartServiceCommand: nil,
		RequireSingleInstance: false,
		// A consumed (deleted) message is gone; a new subscriber does not get it again.
		NewSubscriberReceivesOldMessages: false,
		// The suite's long variants publish 5,000-10,000 messages per test through one
		// SendMessage call each; goaws scans a queue's whole message list on every receive, and
		// under -race that takes minutes. The short variants (50-100 messages, 10 subscribers)
		// exercise the same paths.
		ForceShort: true,
		// The message context does not travel through SQS.
		ContextPreserved: false,
		// Topic names are "topic-<uuid>" (42 characters), plus "-<n>" in
		// TestConcurrentSubscribeMultipleTopics: valid SQS queue names within 80 characters.
		GenerateTopicFunc: nil,
	}
	tests.TestPubSub(t, features, suitePubSub, func(t *testing.T, _ string) (message.Publisher, message.Subscriber) {
		t.Fatal("consumer groups are not supported; the suite must not call this")
		return nil, nil
	})
}

// suitePubSub builds a Publisher and a Subscriber for the suite. Queues the suite creates
// (SubscribeInitialize) get a 5 s visibility timeout: long enough for the extension every
// 1.7 s, short enough that a message lost by a receive that Close aborted mid-response comes
// back within the suite's 15 s read timeouts.
func suitePubSub(t *testing.T) (message.Publisher, message.Subscriber) {
	logger := watermill.NewStdLogger(false, false)
	pub, err := sqs.NewPublisher(sqs.PublisherConfig{
		AWSConfig: awsConfig(),
		OptFns:    fastSubscriberConfig(nil).OptFns,
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := sqs.NewSubscriber(fastSubscriberConfig(func(c *sqs.SubscriberConfig) {
		c.QueueAttributes = map[string]string{"VisibilityTimeout": "5"}
	}), logger)
	if err != nil {
		t.Fatal(err)
	}
	return pub, sub
}
