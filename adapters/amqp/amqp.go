// Package amqp connects the inbox to RabbitMQ (AMQP 0-9-1) through watermill-amqp v3, with
// durable queues named after the topic, manual acks after the inbox commit, and two fixes for
// failure modes of the default setup:
//
//   - Headers of other than string type, which RabbitMQ adds itself (x-death, a table, on every
//     dead-lettering; x-delivery-count, an integer, on quorum queues), make watermill-amqp
//     v3.0.2's default unmarshaler fail, and the subscriber's Nack requeues such a message
//     forever. This adapter's unmarshaler drops those headers (they describe deliveries, see
//     BrokerSideFields) and keeps every string header as metadata.
//   - watermill-amqp's publisher sends through the default exchange and does not declare the
//     queue, and RabbitMQ silently drops a message routed to a queue that does not exist. This
//     adapter's publisher declares each topic's queue before its first publish, so a dead
//     letter or an outbox relay never publishes into nothing.
package amqp

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Name is the adapter's name in router configuration.
const Name = "amqp"

// BrokerSideFields are the headers and metadata RabbitMQ and watermill-amqp attach to a
// delivery. None identifies the message.
var BrokerSideFields = map[string]string{
	wamqp.MetadataRedeliveredKey: "watermill-amqp sets it when RabbitMQ flags a redelivery (basic.deliver redelivered)",
	"x-delivery-count":           "RabbitMQ quorum queues count deliveries in it",
	"x-death":                    "RabbitMQ appends to it on every dead-lettering",
	"x-first-death-queue":        "RabbitMQ sets it when a message is first dead-lettered",
	"x-first-death-reason":       "RabbitMQ sets it when a message is first dead-lettered",
	"x-first-death-exchange":     "RabbitMQ sets it when a message is first dead-lettered",
	"x-last-death-queue":         "RabbitMQ sets it on every dead-lettering",
	"x-last-death-reason":        "RabbitMQ sets it on every dead-lettering",
	"x-last-death-exchange":      "RabbitMQ sets it on every dead-lettering",
}

// Config configures the RabbitMQ broker.
type Config struct {
	// URL is the AMQP URI (required), e.g. amqp://guest:guest@127.0.0.1:5672/.
	URL string
	// Prefetch is the number of unacked messages RabbitMQ hands each subscription (basic.qos).
	// watermill-amqp processes one message at a time per subscription. Default: 16.
	Prefetch int
	// QueueArguments are passed to queue.declare (e.g. x-queue-type: quorum, x-expires).
	QueueArguments map[string]any
	// Consumers is the number of AMQP consumers (each on a channel of its own, with its own
	// Prefetch) that each Subscribe call opens on the queue; their deliveries arrive on the
	// one channel Subscribe returns, so a router handler processes up to Consumers messages at
	// once. Default: 1 (watermill-amqp's single consumer, one message at a time).
	Consumers int
	// PublishChannelPoolSize is the number of channels the publisher keeps open and shares
	// between concurrent Publish calls. Default: 0, a channel opened and closed per Publish
	// call (watermill-amqp's default), which costs round trips on every one-message publish.
	PublishChannelPoolSize int
}

// Validate returns an error wrapping inbox.ErrInvalidConfig for an empty URL or a negative
// Prefetch, Consumers or PublishChannelPoolSize.
func (c Config) Validate() error {
	if c.URL == "" {
		return fmt.Errorf("%w: amqp adapter: URL is required", inbox.ErrInvalidConfig)
	}
	if c.Prefetch < 0 {
		return fmt.Errorf("%w: amqp adapter: negative Prefetch", inbox.ErrInvalidConfig)
	}
	if c.Consumers < 0 || c.PublishChannelPoolSize < 0 {
		return fmt.Errorf("%w: amqp adapter: negative Consumers or PublishChannelPoolSize", inbox.ErrInvalidConfig)
	}
	return nil
}

// WatermillConfig returns the watermill-amqp configuration the adapter uses: durable queues
// named after the topic, publisher confirms, and the tolerant unmarshaler.
func (c Config) WatermillConfig() wamqp.Config {
	cfg := wamqp.NewDurableQueueConfig(c.URL)
	cfg.Marshaler = Marshaler{}
	cfg.Queue.Arguments = c.QueueArguments
	cfg.Consume.Qos.PrefetchCount = c.Prefetch
	if cfg.Consume.Qos.PrefetchCount == 0 {
		cfg.Consume.Qos.PrefetchCount = 16
	}
	cfg.Publish.ConfirmDelivery = true
	cfg.Publish.ChannelPoolSize = c.PublishChannelPoolSize
	return cfg
}

// New returns the broker: a publisher that declares each topic's queue before its first
// publish, and a subscriber on durable queues.
func New(cfg Config, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	wcfg := cfg.WatermillConfig()
	sub, err := wamqp.NewSubscriber(wcfg, logger)
	if err != nil {
		return nil, fmt.Errorf("amqp adapter: subscriber: %w", err)
	}
	pub, err := wamqp.NewPublisher(wcfg, logger)
	if err != nil {
		_ = sub.Close()
		return nil, fmt.Errorf("amqp adapter: publisher: %w", err)
	}
	return &adapters.Broker{
		Name: Name,
		Publisher: adapters.DeclaringPublisher(pub, func(topic string) error {
			if err := sub.SubscribeInitialize(topic); err != nil {
				return fmt.Errorf("amqp adapter: queue.declare: %w", err)
			}
			return nil
		}),
		Subscriber:       consumers(sub, cfg.Consumers),
		BrokerSideFields: BrokerSideFields,
	}, nil
}

// Marshaler is watermill-amqp's DefaultMarshaler, except that Unmarshal drops headers that
// are not strings (RabbitMQ's x-death table, x-delivery-count integer) instead of failing.
type Marshaler struct{ wamqp.DefaultMarshaler }

// Unmarshal implements wamqp.Marshaler.
func (m Marshaler) Unmarshal(d amqp091.Delivery) (*message.Message, error) {
	headers := make(amqp091.Table, len(d.Headers))
	for k, v := range d.Headers {
		if _, ok := v.(string); ok {
			headers[k] = v
		}
	}
	d.Headers = headers
	return m.DefaultMarshaler.Unmarshal(d)
}
