// Package amqp connects the inbox to RabbitMQ (AMQP 0-9-1) through watermill-amqp v3.
//
// # Topology: fan-out per consumer group
//
// Each topic is a durable fanout exchange named after the topic. Each consumer group has a
// durable queue of its own bound to it: "<topic>_<group>" (watermill-amqp's
// GenerateQueueNameTopicNameWithSuffix), and the default group (Broker.Subscriber) the queue
// named after the topic. Every group's queue receives a copy of every message published after
// the queue was declared and bound (the first Subscribe or SubscribeInitialize of the group,
// which package router does when a consumer is added, before the router runs); the
// subscriptions of one group compete for its queue.
//
// RabbitMQ keeps no log: a message published while no queue is bound to the topic's exchange
// would be dropped. Every topic exchange is declared with an alternate exchange
// (Config.UnroutedQueue), so such a message is kept in that one queue instead, for an
// operator to inspect or shovel; it is not delivered to a group that subscribes later. To
// have a group's queue exist before the first publish, list the group in
// Config.DeclareGroups (the publisher then declares and binds its queue before its first
// publish to each topic) or subscribe it before publishing.
//
// # Fixes to the default setup
//
//   - Headers of other than string type, which RabbitMQ adds itself (x-death, a table, on every
//     dead-lettering; x-delivery-count, an integer, on quorum queues), make watermill-amqp
//     v3.0.2's default unmarshaler fail, and the subscriber's Nack requeues such a message
//     forever. This adapter's unmarshaler keeps string headers as metadata, x-delivery-count
//     as its decimal string, x-death as "present" (see Redelivery), and drops the rest.
//   - watermill-amqp's publisher would publish to an exchange with nothing bound and RabbitMQ
//     silently drops such a message: see the alternate exchange above.
package amqp

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Name is the adapter's name in router configuration, registered when the package is imported
// (driver.go).
const Name = "amqp"

// BrokerSideFields are the headers and metadata RabbitMQ and watermill-amqp attach to a
// delivery. None identifies the message.
var BrokerSideFields = brokerside.AMQP

// DefaultUnroutedQueue is the default of Config.UnroutedQueue.
const DefaultUnroutedQueue = "watermill-inbox.unrouted"

// Config configures the RabbitMQ broker.
type Config struct {
	// URL is the AMQP URI (required), e.g. amqp://guest:guest@127.0.0.1:5672/.
	URL string
	// Prefetch is the number of unacked messages RabbitMQ hands each subscription (basic.qos).
	// watermill-amqp processes one message at a time per subscription. Default: 16.
	Prefetch int
	// QueueArguments are passed to queue.declare of every consumer group's queue (e.g.
	// x-queue-type: quorum, x-expires).
	QueueArguments map[string]any
	// UnroutedQueue names the fanout exchange declared as every topic exchange's
	// alternate-exchange, and the durable queue bound to it: a message published to a topic
	// with no queue bound lands there instead of being dropped. Default: DefaultUnroutedQueue.
	// Changing it for an existing topic fails its exchange declaration (RabbitMQ refuses to
	// redeclare an exchange with other arguments).
	UnroutedQueue string
	// DeclareGroups are consumer groups whose queues the publisher declares and binds before
	// its first publish to each topic, so that they receive messages published before their
	// consumers first subscribe; "" is the default group (the queue named after the topic).
	// Optional.
	DeclareGroups []string
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

// QueueName returns the queue of consumer group on topic: the topic for the default group "",
// else "<topic>_<group>".
func QueueName(topic, group string) string {
	if group == "" {
		return topic
	}
	return wamqp.GenerateQueueNameTopicNameWithSuffix(group)(topic)
}

func (c Config) unrouted() string {
	if c.UnroutedQueue == "" {
		return DefaultUnroutedQueue
	}
	return c.UnroutedQueue
}

// WatermillConfig returns the watermill-amqp configuration of consumer group's subscriber (""
// for the default group) and of the publisher: a durable fanout exchange per topic with the
// unrouted alternate exchange, the group's durable queue bound to it, publisher confirms, and
// the tolerant unmarshaler.
func (c Config) WatermillConfig(group string) wamqp.Config {
	cfg := wamqp.NewDurablePubSubConfig(c.URL, func(topic string) string { return QueueName(topic, group) })
	cfg.Marshaler = Marshaler{}
	cfg.Queue.Arguments = c.QueueArguments
	cfg.Exchange.Arguments = amqp091.Table{"alternate-exchange": c.unrouted()}
	cfg.TopologyBuilder = &topology{unrouted: c.unrouted()}
	cfg.Consume.Qos.PrefetchCount = c.Prefetch
	if cfg.Consume.Qos.PrefetchCount == 0 {
		cfg.Consume.Qos.PrefetchCount = 16
	}
	cfg.Publish.ConfirmDelivery = true
	cfg.Publish.ChannelPoolSize = c.PublishChannelPoolSize
	cfg.Publish.ChannelPoolSize = c.PublishChannelPoolSize
	return cfg
}

// New returns the broker: a publisher on the topics' fanout exchanges (declaring the queues of
// DeclareGroups before its first publish to a topic), the default group's subscriber, and
// NewSubscriber for every other consumer group (a connection each).
func New(cfg Config, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	// The URL's password never reaches a log line or an error (internal/redact).
	logger = redact.Logger(logger, cfg.URL)
	newSub := func(group string) (*wamqp.Subscriber, error) {
		sub, err := wamqp.NewSubscriber(cfg.WatermillConfig(group), logger)
		if err != nil {
			return nil, fmt.Errorf("amqp adapter: subscriber of consumer group %q at %s: %w", group, redact.URL(cfg.URL), redact.Err(err, cfg.URL))
		}
		return sub, nil
	}
	sub, err := newSub("")
	if err != nil {
		return nil, err
	}
	pub, err := wamqp.NewPublisher(cfg.WatermillConfig(""), logger)
	if err != nil {
		_ = sub.Close()
		return nil, fmt.Errorf("amqp adapter: publisher at %s: %w", redact.URL(cfg.URL), redact.Err(err, cfg.URL))
	}
	b := &adapters.Broker{
		Name:       Name,
		Publisher:  pub,
		Subscriber: consumers(sub, cfg.Consumers),
		NewSubscriber: func(group string) (message.Subscriber, error) {
			if group == "" {
				return nil, fmt.Errorf("%w: amqp adapter: empty consumer group", inbox.ErrInvalidConfig)
			}
			s, err := newSub(group)
			if err != nil {
				return nil, err
			}
			return consumers(s, cfg.Consumers), nil
		},
		BrokerSideFields: BrokerSideFields,
		Redelivery:       Redelivery,
	}
	if len(cfg.DeclareGroups) > 0 {
		d := &declarer{groups: slices.Clone(cfg.DeclareGroups), subs: map[string]*wamqp.Subscriber{"": sub}, newSub: newSub}
		b.Publisher = adapters.DeclaringPublisher(pub, d.declare)
		b.Closers = append(b.Closers, d.close)
	}
	return b, nil
}

// declarer declares and binds the queues of DeclareGroups for a topic, through one subscriber
// per group (SubscribeInitialize), made on first use.
type declarer struct {
	groups []string
	newSub func(group string) (*wamqp.Subscriber, error)
	mu     sync.Mutex
	subs   map[string]*wamqp.Subscriber
}

func (d *declarer) declare(topic string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, g := range d.groups {
		s, ok := d.subs[g]
		if !ok {
			var err error
			if s, err = d.newSub(g); err != nil {
				return err
			}
			d.subs[g] = s
		}
		if err := s.SubscribeInitialize(topic); err != nil {
			return fmt.Errorf("amqp adapter: declaring queue %q: %w", QueueName(topic, g), err)
		}
	}
	return nil
}

// close closes the subscribers declare made (not the default group's: Broker.Close does).
func (d *declarer) close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	var errs []error
	for g, s := range d.subs {
		if g != "" {
			errs = append(errs, s.Close())
		}
	}
	return errors.Join(errs...)
}

// topology is watermill-amqp's DefaultTopologyBuilder, except that before declaring a topic's
// exchange it declares the unrouted fanout exchange and queue its alternate-exchange argument
// names, so that exchange exists before anything is published.
type topology struct {
	wamqp.DefaultTopologyBuilder
	unrouted string
}

// ExchangeDeclare implements wamqp.TopologyBuilder.
func (t *topology) ExchangeDeclare(ch *amqp091.Channel, exchange string, cfg wamqp.Config) error {
	if err := ch.ExchangeDeclare(t.unrouted, "fanout", true, false, false, false, nil); err != nil {
		return fmt.Errorf("declaring the unrouted exchange %q: %w", t.unrouted, err)
	}
	if _, err := ch.QueueDeclare(t.unrouted, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declaring the unrouted queue %q: %w", t.unrouted, err)
	}
	if err := ch.QueueBind(t.unrouted, "", t.unrouted, false, nil); err != nil {
		return fmt.Errorf("binding the unrouted queue %q: %w", t.unrouted, err)
	}
	return t.DefaultTopologyBuilder.ExchangeDeclare(ch, exchange, cfg)
}

// BuildTopology implements wamqp.TopologyBuilder: queue, then exchange (through
// ExchangeDeclare), then binding.
func (t *topology) BuildTopology(ch *amqp091.Channel, p wamqp.BuildTopologyParams, cfg wamqp.Config, logger watermill.LoggerAdapter) error {
	if _, err := ch.QueueDeclare(p.QueueName, cfg.Queue.Durable, cfg.Queue.AutoDelete, cfg.Queue.Exclusive, cfg.Queue.NoWait, cfg.Queue.Arguments); err != nil {
		return fmt.Errorf("declaring queue %q: %w", p.QueueName, err)
	}
	if err := t.ExchangeDeclare(ch, p.ExchangeName, cfg); err != nil {
		return fmt.Errorf("declaring exchange %q: %w", p.ExchangeName, err)
	}
	if err := ch.QueueBind(p.QueueName, p.RoutingKey, p.ExchangeName, cfg.QueueBind.NoWait, cfg.QueueBind.Arguments); err != nil {
		return fmt.Errorf("binding queue %q to exchange %q: %w", p.QueueName, p.ExchangeName, err)
	}
	return nil
}

// Redelivery is the adapter's inbox.RedeliveryFunc. RabbitMQ sets basic.deliver's redelivered
// flag on every delivery that may have been delivered before (watermill-amqp copies it into
// metadata MetadataRedeliveredKey = "true"), and per RabbitMQ's reliability guide an unset flag
// guarantees the message has not been delivered from that queue before. A message that a
// quorum queue counted (x-delivery-count above 0) or that was dead-lettered into this queue
// (x-death) was delivered before elsewhere: Redelivered too. Otherwise FirstDelivery.
func Redelivery(msg *message.Message) inbox.Redelivery {
	if msg.Metadata.Get(wamqp.MetadataRedeliveredKey) == "true" {
		return inbox.Redelivered
	}
	if _, ok := msg.Metadata[deathHeader]; ok {
		return inbox.Redelivered
	}
	if n := msg.Metadata.Get(deliveryCountHeader); n != "" && n != "0" {
		return inbox.Redelivered
	}
	return inbox.FirstDelivery
}

const (
	deathHeader         = "x-death"
	deliveryCountHeader = "x-delivery-count"
)

// Marshaler is watermill-amqp's DefaultMarshaler, except that Unmarshal never fails on
// headers that are not strings: RabbitMQ's x-delivery-count integer becomes its decimal
// string, its x-death table the string "present", other non-string headers are dropped, and a
// string x-death or x-delivery-count (not RabbitMQ's) is dropped too.
type Marshaler struct{ wamqp.DefaultMarshaler }

// Unmarshal implements wamqp.Marshaler.
func (m Marshaler) Unmarshal(d amqp091.Delivery) (*message.Message, error) {
	headers := make(amqp091.Table, len(d.Headers))
	for k, v := range d.Headers {
		switch v := v.(type) {
		case string:
			if k != deathHeader && k != deliveryCountHeader { // only RabbitMQ's own values count
				headers[k] = v
			}
		case int8, int16, int32, int64, uint8, uint16, uint32, uint64, int:
			if k == deliveryCountHeader {
				headers[k] = fmt.Sprint(v)
			}
		}
	}
	if _, ok := d.Headers[deathHeader]; ok {
		headers[deathHeader] = "present"
	}
	d.Headers = headers
	return m.DefaultMarshaler.Unmarshal(d)
}
