package sqs

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/schemas"
	"github.com/aws/smithy-go/transport/http/protocol/awsquery"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Name is the adapter's name in router configuration, registered when the package is imported
// (driver.go).
const Name = "sqs"

// QueryProtocol is an OptFns function that switches the SQS client from the default AWS JSON
// protocol to the older AWS query protocol, the only one some SQS-compatible endpoints speak
// (goaws). Amazon SQS itself speaks both; against AWS leave the default JSON protocol. It must
// be an option function: the client constructor overwrites a Protocol set in a plain Options
// value.
func QueryProtocol(o *awssqs.Options) { o.Protocol = awsquery.New(schemas.AmazonSQS) }

// Endpoint returns an OptFns function that sends every request to url (BaseEndpoint), e.g.
// http://127.0.0.1:4100 for a local SQS-compatible endpoint, instead of the endpoint AWS
// resolves from the region.
func Endpoint(url string) func(*awssqs.Options) {
	return func(o *awssqs.Options) { o.BaseEndpoint = aws.String(url) }
}

// BrokerConfig configures the broker New returns: a Publisher and a Subscriber on one AWS
// configuration. The zero value of every field except AWSConfig is valid; the subscriber
// fields mean what the SubscriberConfig fields of the same name mean, with the same
// defaults.
type BrokerConfig struct {
	// AWSConfig holds the region (required), credentials, retryer and HTTP client, usually
	// from config.LoadDefaultConfig (github.com/aws/aws-sdk-go-v2/config).
	AWSConfig aws.Config
	// OptFns are applied to every SQS client after AWSConfig, e.g. Endpoint and
	// QueryProtocol for a local SQS-compatible endpoint. Optional.
	OptFns []func(*awssqs.Options)

	// QueueAttributes are the attributes of the queues the broker creates (a topic's queue
	// is created when the Publisher first publishes to it or the Subscriber first subscribes
	// to it and it does not exist yet), e.g. {"VisibilityTimeout": "60"}. Queues that exist
	// are used as they are. Optional.
	QueueAttributes map[string]string

	// FIFOMessageGroupID: see PublisherConfig.FIFOMessageGroupID.
	FIFOMessageGroupID func(topic string, msg *message.Message) (string, error)

	// Subscriber knobs: see SubscriberConfig.
	WaitTime                time.Duration
	MaxNumberOfMessages     int32
	MaxInFlight             int
	VisibilityTimeout       time.Duration
	CloseTimeout            time.Duration
	RequestTimeout          time.Duration
	ReconnectBackoffInitial time.Duration
	ReconnectBackoffMax     time.Duration
}

// PublisherConfig returns the configuration of the broker's Publisher.
func (c BrokerConfig) PublisherConfig() PublisherConfig {
	return PublisherConfig{AWSConfig: c.AWSConfig, OptFns: c.OptFns, FIFOMessageGroupID: c.FIFOMessageGroupID}
}

// SubscriberConfig returns the configuration of the broker's Subscriber.
func (c BrokerConfig) SubscriberConfig() SubscriberConfig {
	return SubscriberConfig{
		AWSConfig:               c.AWSConfig,
		OptFns:                  c.OptFns,
		WaitTime:                c.WaitTime,
		MaxNumberOfMessages:     c.MaxNumberOfMessages,
		MaxInFlight:             c.MaxInFlight,
		VisibilityTimeout:       c.VisibilityTimeout,
		QueueAttributes:         c.QueueAttributes,
		CloseTimeout:            c.CloseTimeout,
		RequestTimeout:          c.RequestTimeout,
		ReconnectBackoffInitial: c.ReconnectBackoffInitial,
		ReconnectBackoffMax:     c.ReconnectBackoffMax,
	}
}

// New returns the SQS broker for the inbox. Its Publisher resolves each topic's queue before
// the first publish to it and creates it (with QueueAttributes) when it does not exist, so a
// dead letter or an outbox relay never fails on a queue nobody subscribed to yet; its
// Subscriber does the same before each Subscribe (the plain Subscriber only resolves). A
// topic is one queue, and so one consumer group: every consumer of the queue shares its
// messages: the broker has no NewSubscriber (adapters.ErrNoFanOut), so give each topic one
// consumer name. BrokerSideFields are the SQS system attributes (ReceiptHandle, MessageId, ...).
//
// No network call is made. IAM permissions: those of Publisher and Subscriber, and
// sqs:CreateQueue unless every queue exists beforehand. An invalid configuration gives an
// error wrapping both ErrInvalidConfig and inbox.ErrInvalidConfig, as every adapter's does.
func New(cfg BrokerConfig, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	// Payload fields redacted, control characters in values quoted (internal/redact).
	logger = redact.Logger(logger)
	sub, err := NewSubscriber(cfg.SubscriberConfig(), logger)
	if err != nil {
		return nil, fmt.Errorf("%w: sqs adapter: subscriber: %w", inbox.ErrInvalidConfig, err)
	}
	pub, err := NewPublisher(cfg.PublisherConfig(), logger)
	if err != nil {
		_ = sub.Close()
		return nil, fmt.Errorf("%w: sqs adapter: publisher: %w", inbox.ErrInvalidConfig, err)
	}
	return &adapters.Broker{
		Name: Name,
		Publisher: adapters.DeclaringPublisher(pub, func(topic string) error {
			return sub.ensureQueue(context.Background(), topic)
		}),
		Subscriber:       ensuringSubscriber{sub},
		BrokerSideFields: BrokerSideFields,
		Redelivery:       Redelivery,
		// NewSubscriber stays nil: an SQS queue has no consumer groups, so every consumer of a
		// topic's queue competes for its messages. Fan-out needs a topic that copies each
		// message into one queue per consumer group (SNS), which this adapter does not have.
	}, nil
}

// ensuringSubscriber is the broker's Subscriber: it resolves or creates the queue before
// subscribing.
type ensuringSubscriber struct{ *Subscriber }

var (
	_ message.Subscriber           = ensuringSubscriber{}
	_ message.SubscribeInitializer = ensuringSubscriber{}
)

// Subscribe resolves the topic's queue, creates it with QueueAttributes when it does not
// exist, and subscribes (Subscriber.Subscribe).
func (s ensuringSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if s.isClosed() {
		return nil, ErrSubscriberClosed
	}
	if err := s.ensureQueue(ctx, topic); err != nil {
		return nil, err
	}
	return s.Subscriber.Subscribe(ctx, topic)
}

// ensureQueue resolves the URL of topic's queue (GetQueueUrl, cached) and creates the queue
// with QueueAttributes when SQS reports it missing. Each call is bounded by RequestTimeout.
// It does not look at whether the Subscriber is closed: the broker's Publisher uses it too.
func (s *Subscriber) ensureQueue(ctx context.Context, topic string) error {
	ctx, cancel := context.WithTimeout(ctx, s.config.RequestTimeout)
	defer cancel()
	_, err := s.queues.url(ctx, topic)
	if !errors.Is(err, ErrQueueNotFound) {
		return err
	}
	_, err = s.queues.create(ctx, topic, s.config.QueueAttributes)
	return err
}
