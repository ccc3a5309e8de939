package sqstest_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

func TestSubscriberConfigValidate(t *testing.T) {
	t.Parallel()
	cases := map[string]struct {
		modify  func(*sqs.SubscriberConfig)
		wantErr string // substring; "" means valid
	}{
		"defaults": {func(*sqs.SubscriberConfig) {}, ""},
		"region from OptFns": {func(c *sqs.SubscriberConfig) {
			c.AWSConfig = aws.Config{}
			c.OptFns = []func(*awssqs.Options){func(o *awssqs.Options) { o.Region = "eu-west-1" }}
		}, ""},
		"no region":                  {func(c *sqs.SubscriberConfig) { c.AWSConfig = aws.Config{} }, "Region"},
		"wait below 1s":              {func(c *sqs.SubscriberConfig) { c.WaitTime = 500 * time.Millisecond }, "WaitTime"},
		"wait above 20s":             {func(c *sqs.SubscriberConfig) { c.WaitTime = 21 * time.Second }, "WaitTime"},
		"11 messages per receive":    {func(c *sqs.SubscriberConfig) { c.MaxNumberOfMessages = 11 }, "MaxNumberOfMessages"},
		"negative in flight":         {func(c *sqs.SubscriberConfig) { c.MaxInFlight = -1 }, "MaxInFlight"},
		"visibility above 12h":       {func(c *sqs.SubscriberConfig) { c.VisibilityTimeout = 13 * time.Hour }, "VisibilityTimeout"},
		"negative close timeout":     {func(c *sqs.SubscriberConfig) { c.CloseTimeout = -time.Second }, "CloseTimeout"},
		"backoff initial above max":  {func(c *sqs.SubscriberConfig) { c.ReconnectBackoffInitial = time.Minute }, "ReconnectBackoff"},
		"explicit visibility, 1 msg": {func(c *sqs.SubscriberConfig) { c.VisibilityTimeout = time.Minute; c.MaxNumberOfMessages = 1 }, ""},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			c := sqs.SubscriberConfig{AWSConfig: awsConfig()}
			tc.modify(&c)
			_, err := sqs.NewSubscriber(c, nil)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("NewSubscriber: %v", err)
			case tc.wantErr != "" && (!errors.Is(err, sqs.ErrInvalidConfig) || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("NewSubscriber error = %v, want ErrInvalidConfig naming %s", err, tc.wantErr)
			}
		})
	}
	if _, err := sqs.NewPublisher(sqs.PublisherConfig{}, nil); !errors.Is(err, sqs.ErrInvalidConfig) {
		t.Errorf("NewPublisher without region: %v, want ErrInvalidConfig", err)
	}
}

func TestValidateQueueName(t *testing.T) {
	t.Parallel()
	valid := []string{"a", "payments", "Pay_ments-1", strings.Repeat("q", 80), strings.Repeat("q", 75) + ".fifo", "orders.fifo"}
	invalid := []string{"", ".fifo", "has space", "dot.ted", "slash/", "ümlaut", strings.Repeat("q", 81), strings.Repeat("q", 76) + ".fifo", "x.fifo.fifo"}
	for _, name := range valid {
		if err := sqs.ValidateQueueName(name); err != nil {
			t.Errorf("ValidateQueueName(%q) = %v, want nil", name, err)
		}
	}
	for _, name := range invalid {
		if err := sqs.ValidateQueueName(name); !errors.Is(err, sqs.ErrInvalidQueueName) {
			t.Errorf("ValidateQueueName(%q) = %v, want ErrInvalidQueueName", name, err)
		}
	}
}

// TestPublishRefusesWhatSQSRefuses: messages SQS would refuse fail before any network call
// (the publisher points at an unroutable endpoint to prove it), with ErrInvalidMessage or
// ErrInvalidQueueName.
func TestPublishRefusesWhatSQSRefuses(t *testing.T) {
	t.Parallel()
	pub, err := sqs.NewPublisher(sqs.PublisherConfig{
		AWSConfig: awsConfig(),
		OptFns:    []func(*awssqs.Options){func(o *awssqs.Options) { o.BaseEndpoint = aws.String("http://192.0.2.1:9") }},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	tooMany := message.NewMessage(watermill.NewUUID(), []byte("x"))
	for i := range sqs.MaxMessageAttributes { // + the UUID attribute = 11
		tooMany.Metadata.Set("k"+string(rune('a'+i)), "v")
	}
	withMeta := func(k, v string) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte("x"))
		m.Metadata.Set(k, v)
		return m
	}
	cases := map[string]*message.Message{
		"empty payload":         message.NewMessage(watermill.NewUUID(), nil),
		"binary payload":        message.NewMessage(watermill.NewUUID(), []byte{0x00, 0xff}),
		"control character":     message.NewMessage(watermill.NewUUID(), []byte("a\x01b")),
		"11 attributes":         tooMany,
		"reserved prefix":       withMeta("AWS.trace", "v"),
		"reserved prefix (any)": withMeta("amazon.x", "v"),
		"double dot":            withMeta("a..b", "v"),
		"space in name":         withMeta("a b", "v"),
		"UUID attribute":        withMeta(sqs.UUIDAttribute, "other"),
		"control char in value": withMeta("k", "a\x02"),
	}
	for name, msg := range cases {
		if err := pub.Publish("valid-queue", msg); !errors.Is(err, sqs.ErrInvalidMessage) {
			t.Errorf("%s: Publish = %v, want ErrInvalidMessage", name, err)
		}
	}
	if err := pub.Publish("not a queue", message.NewMessage(watermill.NewUUID(), []byte("x"))); !errors.Is(err, sqs.ErrInvalidQueueName) {
		t.Errorf("invalid topic: Publish = %v, want ErrInvalidQueueName", err)
	}
	_ = pub.Close()
	if err := pub.Publish("valid-queue", message.NewMessage(watermill.NewUUID(), []byte("x"))); !errors.Is(err, sqs.ErrPublisherClosed) {
		t.Errorf("after Close: Publish = %v, want ErrPublisherClosed", err)
	}
}

// TestSubscribeToMissingQueue: Subscribe does not create queues; it fails with
// ErrQueueNotFound, and after Close with ErrSubscriberClosed.
func TestSubscribeToMissingQueue(t *testing.T) {
	t.Parallel()
	sub := newSubscriber(t, nil)
	if _, err := sub.Subscribe(t.Context(), queueName(t)); !errors.Is(err, sqs.ErrQueueNotFound) {
		t.Errorf("Subscribe to a missing queue: %v, want ErrQueueNotFound", err)
	}
	if err := newPublisher(t).Publish(queueName(t), message.NewMessage(watermill.NewUUID(), []byte("x"))); !errors.Is(err, sqs.ErrQueueNotFound) {
		t.Errorf("Publish to a missing queue: %v, want ErrQueueNotFound", err)
	}
	_ = sub.Close()
	if _, err := sub.Subscribe(t.Context(), queueName(t)); !errors.Is(err, sqs.ErrSubscriberClosed) {
		t.Errorf("Subscribe after Close: %v, want ErrSubscriberClosed", err)
	}
	if err := sub.SubscribeInitialize(queueName(t)); !errors.Is(err, sqs.ErrSubscriberClosed) {
		t.Errorf("SubscribeInitialize after Close: %v, want ErrSubscriberClosed", err)
	}
}

// TestBrokerSideFieldsRefusedByInbox: the SQS delivery fields that middleware/key.go already
// lists are refused by inbox.MetadataKey. The other names of sqs.BrokerSideFields
// (MessageId, SequenceNumber, SentTimestamp, ...) are not in that list yet; they are logged
// here, not asserted, because the middleware package is not this adapter's to change.
func TestBrokerSideFieldsRefusedByInbox(t *testing.T) {
	t.Parallel()
	refusedToday := []string{"ReceiptHandle", "ApproximateReceiveCount"}
	for _, name := range refusedToday {
		if _, ok := sqs.BrokerSideFields[name]; !ok {
			t.Errorf("BrokerSideFields lacks %q", name)
		}
		if _, err := inbox.MetadataKey(name); !errors.Is(err, inbox.ErrBrokerSideKey) {
			t.Errorf("inbox.MetadataKey(%q) = %v, want ErrBrokerSideKey", name, err)
		}
	}
	for name := range sqs.BrokerSideFields {
		if _, err := inbox.MetadataKey(name); err == nil {
			t.Logf("inbox.MetadataKey does not refuse SQS field %q yet (%s)", name, sqs.BrokerSideFields[name])
		}
	}
}
