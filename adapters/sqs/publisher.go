package sqs

import (
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
)

// Publisher sends Watermill messages to SQS queues; the topic is the queue name. It implements
// message.Publisher and is safe for concurrent use.
type Publisher struct {
	config PublisherConfig
	logger watermill.LoggerAdapter
	client *awssqs.Client
	queues *queues

	mu       sync.RWMutex // held for reading by each Publish, for writing by Close
	closed   bool
	inflight sync.WaitGroup
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher fills in config's defaults, validates it and returns a Publisher. A nil logger
// discards logs. The error wraps ErrInvalidConfig. No network call is made.
func NewPublisher(config PublisherConfig, logger watermill.LoggerAdapter) (*Publisher, error) {
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	client := awssqs.NewFromConfig(config.AWSConfig, config.OptFns...)
	return &Publisher{config: config, logger: logger, client: client, queues: newQueues(client)}, nil
}

// Publish sends msgs to the queue named topic, one SendMessage call per message, in order,
// each with the message's context (msg.Context()). The payload is the body; the UUID travels
// in the UUIDAttribute message attribute and each non-empty metadata field in a String
// message attribute. For a FIFO queue (topic ending in ".fifo") the MessageGroupId comes from
// FIFOMessageGroupID and the MessageDeduplicationId is the message UUID, so SQS drops a
// producer's retry of the same message within its 5-minute deduplication interval.
//
// The first failure stops the call: messages before it stay sent. Errors wrap
// ErrPublisherClosed, ErrInvalidQueueName, ErrQueueNotFound, ErrInvalidMessage (checked
// before sending: empty or non-text payload, more than MaxMessageAttributes attributes,
// invalid attribute name) or the SDK's error. Payloads are never logged.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	if p.closed {
		p.mu.RUnlock()
		return ErrPublisherClosed
	}
	p.inflight.Add(1)
	p.mu.RUnlock()
	defer p.inflight.Done()

	for _, msg := range msgs {
		if err := p.publish(topic, msg); err != nil {
			return err
		}
	}
	return nil
}

func (p *Publisher) publish(topic string, msg *message.Message) error {
	if err := ValidateQueueName(topic); err != nil {
		return err
	}
	body, attrs, err := marshal(msg)
	if err != nil {
		return err
	}
	ctx := msg.Context()
	queueURL, err := p.queues.url(ctx, topic)
	if err != nil {
		return err
	}
	in := &awssqs.SendMessageInput{
		QueueUrl:          aws.String(queueURL),
		MessageBody:       aws.String(body),
		MessageAttributes: attrs,
	}
	if IsFIFO(topic) {
		group, err := p.config.FIFOMessageGroupID(topic, msg)
		if err != nil {
			return fmt.Errorf("sqs: FIFOMessageGroupID for message %q: %w", msg.UUID, err)
		}
		in.MessageGroupId = aws.String(group)
		if msg.UUID != "" {
			in.MessageDeduplicationId = aws.String(msg.UUID)
		}
	}
	out, err := p.client.SendMessage(ctx, in)
	if err != nil {
		if isQueueMissing(err) {
			p.queues.forget(topic)
			return fmt.Errorf("%w: %q: SendMessage of message %q: %w", ErrQueueNotFound, topic, msg.UUID, err)
		}
		return fmt.Errorf("sqs: SendMessage of message %q to %q: %w", msg.UUID, topic, err)
	}
	p.logger.Trace("Message sent to SQS", watermill.LogFields{
		"message_uuid":   msg.UUID,
		"topic":          topic,
		"sqs_message_id": aws.ToString(out.MessageId),
	})
	return nil
}

// Close waits for Publish calls in progress and makes later ones return ErrPublisherClosed.
// It returns nil; calling it again is a no-op.
func (p *Publisher) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.inflight.Wait()
	return nil
}
