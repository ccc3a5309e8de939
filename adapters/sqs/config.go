package sqs

import (
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
)

// ErrInvalidConfig is wrapped by every error that PublisherConfig.Validate and
// SubscriberConfig.Validate return, and so by NewPublisher and NewSubscriber.
var ErrInvalidConfig = errors.New("sqs: invalid config")

// ErrPublisherClosed is returned by Publisher.Publish after Publisher.Close.
var ErrPublisherClosed = errors.New("sqs: publisher is closed")

// ErrSubscriberClosed is returned by Subscriber.Subscribe and Subscriber.SubscribeInitialize
// after Subscriber.Close.
var ErrSubscriberClosed = errors.New("sqs: subscriber is closed")

// Limits of Amazon SQS that the adapter enforces before sending, so that a message SQS would
// refuse fails with a precise error instead of a broker round trip.
const (
	// MaxMessageAttributes is the most message attributes SQS accepts on one message (SQS
	// SendMessage: "each message can have up to 10 attributes"). The producer's message UUID
	// takes one of them, so a Watermill message carries at most 9 non-empty metadata fields.
	MaxMessageAttributes = 10

	// MaxAttributeNameLength is the longest message attribute name SQS accepts, in characters.
	MaxAttributeNameLength = 256

	// MaxQueueNameLength is the longest queue name SQS accepts, in characters, ".fifo" included.
	MaxQueueNameLength = 80

	// MaxReceiveBatch is the most messages one ReceiveMessage call may return (SQS's upper
	// bound for MaxNumberOfMessages).
	MaxReceiveBatch = 10

	// MaxWaitTime is the longest long-polling wait SQS accepts (WaitTimeSeconds = 20).
	MaxWaitTime = 20 * time.Second

	// MaxVisibilityTimeout is the longest visibility timeout SQS accepts (12 hours).
	MaxVisibilityTimeout = 12 * time.Hour
)

// PublisherConfig configures a Publisher. The zero value of every field except AWSConfig is
// valid and replaced by the documented default.
type PublisherConfig struct {
	// AWSConfig holds the region, credentials, retryer and HTTP client, usually from
	// config.LoadDefaultConfig (github.com/aws/aws-sdk-go-v2/config). Region is required.
	// The SDK's retryer retries transient errors of every call (by default 3 attempts).
	AWSConfig aws.Config

	// OptFns are applied to the SQS client after AWSConfig: e.g. set BaseEndpoint to talk to a
	// local SQS-compatible endpoint. Optional.
	OptFns []func(*awssqs.Options)

	// FIFOMessageGroupID returns the MessageGroupId of a message sent to a FIFO queue (a topic
	// ending in ".fifo"); SQS orders and serialises delivery per group. It is not called for
	// standard queues. Default: the topic name, so a FIFO queue is one ordered group. An error
	// fails the Publish call.
	FIFOMessageGroupID func(topic string, msg *message.Message) (string, error)
}

func (c *PublisherConfig) setDefaults() {
	if c.FIFOMessageGroupID == nil {
		c.FIFOMessageGroupID = func(topic string, _ *message.Message) (string, error) { return topic, nil }
	}
}

// Validate returns nil or an error wrapping ErrInvalidConfig that names the first invalid
// field. It is called by NewPublisher after the defaults are filled in.
func (c PublisherConfig) Validate() error {
	if regionOf(c.AWSConfig, c.OptFns) == "" {
		return fmt.Errorf("%w: AWSConfig.Region is required (or set Region in an OptFns function)", ErrInvalidConfig)
	}
	return nil
}

// SubscriberConfig configures a Subscriber. The zero value of every field except AWSConfig is
// valid and replaced by the documented default.
type SubscriberConfig struct {
	// AWSConfig holds the region, credentials, retryer and HTTP client, usually from
	// config.LoadDefaultConfig (github.com/aws/aws-sdk-go-v2/config). Region is required.
	// The SDK's retryer retries transient errors of every call (by default 3 attempts); on top
	// of it the receive loop backs off between failed ReceiveMessage calls (see
	// ReconnectBackoffInitial).
	AWSConfig aws.Config

	// OptFns are applied to the SQS client after AWSConfig: e.g. set BaseEndpoint to talk to a
	// local SQS-compatible endpoint. Optional.
	OptFns []func(*awssqs.Options)

	// WaitTime is the long-polling wait of each ReceiveMessage call (SQS WaitTimeSeconds),
	// rounded up to whole seconds, from 1 s to 20 s. Default 20 s, the SQS maximum: fewer empty
	// responses, fewer billed requests. Short polling (0 s) is not offered: on an empty queue
	// it turns the receive loop into a stream of empty requests.
	WaitTime time.Duration

	// MaxNumberOfMessages is the most messages one ReceiveMessage call asks for, 1 to 10.
	// Default 10. A call never asks for more than the free slots of MaxInFlight.
	MaxNumberOfMessages int32

	// MaxInFlight bounds the messages of one subscription (one Subscribe call) that are
	// received and not yet acked or nacked: the number of messages a Watermill router handles
	// concurrently for that subscription. At least 1. Default 10. Size a database pool for it.
	MaxInFlight int

	// VisibilityTimeout is the visibility timeout requested with each ReceiveMessage call and
	// re-applied by every extension, rounded up to whole seconds, at most 12 h. Default 0: use
	// the queue's VisibilityTimeout attribute, read with GetQueueAttributes when Subscribe
	// starts. While a message is being handled the subscriber extends its visibility
	// (ChangeMessageVisibility) every third of this timeout, so a slow handler's message is
	// not handed to a second consumer. With a timeout below 1 s there is nothing to extend and
	// a slow handler's message becomes visible again. An SQS-compatible endpoint that ignores
	// the per-receive timeout (goaws does) applies the queue's instead, so leave this at 0
	// there. At 0 the subscriber needs the sqs:GetQueueAttributes permission.
	VisibilityTimeout time.Duration

	// QueueAttributes are passed to CreateQueue by SubscribeInitialize, e.g.
	// {"VisibilityTimeout": "60", "RedrivePolicy": "..."} (SQS attribute names and string
	// values). For a topic ending in ".fifo", "FifoQueue": "true" is added. Optional.
	QueueAttributes map[string]string

	// CloseTimeout is how long Close (or the cancellation of a Subscribe context) waits for a
	// message already handed to the handler to be acked or nacked; meanwhile its visibility
	// keeps being extended, and an ack still deletes it. A message not acked by then is made
	// visible again. Default 30 s, the Watermill router's default CloseTimeout.
	CloseTimeout time.Duration

	// RequestTimeout bounds each DeleteMessage and ChangeMessageVisibility call, SDK retries
	// included. These run on a context detached from the subscription so an ack arriving
	// during Close still deletes its message. Default 10 s.
	RequestTimeout time.Duration

	// ReconnectBackoffInitial is the first pause after a failed ReceiveMessage call (broker
	// unreachable, queue missing, throttled); each further consecutive failure doubles it up
	// to ReconnectBackoffMax, with up to 25% random jitter. Default 100 ms.
	ReconnectBackoffInitial time.Duration

	// ReconnectBackoffMax caps the pause between failed ReceiveMessage calls. Default 10 s.
	ReconnectBackoffMax time.Duration
}

func (c *SubscriberConfig) setDefaults() {
	if c.WaitTime == 0 {
		c.WaitTime = MaxWaitTime
	}
	if c.MaxNumberOfMessages == 0 {
		c.MaxNumberOfMessages = MaxReceiveBatch
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = 10
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = 30 * time.Second
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = 10 * time.Second
	}
	if c.ReconnectBackoffInitial == 0 {
		c.ReconnectBackoffInitial = 100 * time.Millisecond
	}
	if c.ReconnectBackoffMax == 0 {
		c.ReconnectBackoffMax = 10 * time.Second
	}
}

// Validate returns nil or an error wrapping ErrInvalidConfig that names the first invalid
// field. It is called by NewSubscriber after the defaults are filled in.
func (c SubscriberConfig) Validate() error {
	switch {
	case regionOf(c.AWSConfig, c.OptFns) == "":
		return fmt.Errorf("%w: AWSConfig.Region is required (or set Region in an OptFns function)", ErrInvalidConfig)
	case c.WaitTime < time.Second || c.WaitTime > MaxWaitTime:
		return fmt.Errorf("%w: WaitTime is %s, must be between 1s and 20s (SQS WaitTimeSeconds)", ErrInvalidConfig, c.WaitTime)
	case c.MaxNumberOfMessages < 1 || c.MaxNumberOfMessages > MaxReceiveBatch:
		return fmt.Errorf("%w: MaxNumberOfMessages is %d, must be between 1 and 10 (SQS limit)", ErrInvalidConfig, c.MaxNumberOfMessages)
	case c.MaxInFlight < 1:
		return fmt.Errorf("%w: MaxInFlight is %d, must be at least 1", ErrInvalidConfig, c.MaxInFlight)
	case c.VisibilityTimeout < 0 || c.VisibilityTimeout > MaxVisibilityTimeout:
		return fmt.Errorf("%w: VisibilityTimeout is %s, must be between 0 (queue attribute) and 12h (SQS limit)", ErrInvalidConfig, c.VisibilityTimeout)
	case c.CloseTimeout < 0:
		return fmt.Errorf("%w: CloseTimeout is %s, must not be negative", ErrInvalidConfig, c.CloseTimeout)
	case c.RequestTimeout < 0:
		return fmt.Errorf("%w: RequestTimeout is %s, must not be negative", ErrInvalidConfig, c.RequestTimeout)
	case c.ReconnectBackoffInitial < 0 || c.ReconnectBackoffMax < c.ReconnectBackoffInitial:
		return fmt.Errorf("%w: ReconnectBackoffInitial (%s) must be positive and at most ReconnectBackoffMax (%s)", ErrInvalidConfig, c.ReconnectBackoffInitial, c.ReconnectBackoffMax)
	}
	return nil
}

// regionOf returns the region an SQS client built from cfg and fns would use.
func regionOf(cfg aws.Config, fns []func(*awssqs.Options)) string {
	return awssqs.NewFromConfig(cfg, fns...).Options().Region
}

// ceilSeconds rounds d up to whole seconds, as SQS takes seconds.
func ceilSeconds(d time.Duration) int32 {
	return int32((d + time.Second - 1) / time.Second)
}
