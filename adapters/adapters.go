// Package adapters holds one package per message broker. Each builds a Watermill Publisher
// and Subscribers from its configuration and declares which metadata fields its broker sets to
// describe a delivery (never a message ID). Each adapter registers a Driver under its name
// when it is imported (Register, as database/sql drivers do); package router picks a
// registered one by configuration, so a handler moves from one broker to another without a
// code change, and a program links only the adapters it imports (package adapters/all imports
// every one). Package adaptertest is the guarantee matrix every adapter passes.
//
// # Consumer groups
//
// A consumer group is the broker-side subscription that one consumer name reads through: every
// consumer group of a topic receives every message of the topic (fan-out), and the
// subscriptions of one consumer group (several handlers, several processes) share its messages
// (competing consumers). Broker.NewSubscriber builds a subscriber for a named consumer group;
// package router gives each inbox consumer name its own.
package adapters

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// ErrNoFanOut is wrapped by the error Broker.NewSubscriber returns on a broker that cannot give
// a consumer group a subscription of its own (SQS: a queue has no consumer groups, and the
// adapter has no topic that copies each message to several queues).
var ErrNoFanOut = errors.New("broker cannot give each consumer group its own subscription")

// Broker is one broker's Watermill Publisher and Subscribers, built by an adapter package.
type Broker struct {
	// Name is the adapter's name: "postgres", "amqp", "kafka", "sqs", "nats" or "redis".
	Name string
	// Publisher publishes to the broker's topics.
	Publisher message.Publisher
	// Subscriber consumes them in the adapter's default consumer group (its Config's
	// ConsumerGroup; for amqp a queue named after the topic; for sqs the topic's queue). Use
	// it for one consumer per topic or for tools (reading a dead-letter topic); give each
	// consumer name its own subscriber with NewSubscriber.
	Subscriber message.Subscriber
	// NewSubscriber returns a new subscriber that consumes in consumer group group: its own
	// queue bound to the topic (amqp), consumer group (kafka, redis), durable consumer (nats)
	// or offset row (postgres). Every group receives every message published to a topic;
	// subscribers of one group, in this process or another, share its messages. The caller
	// closes it (before Broker.Close). Errors wrap inbox.ErrInvalidConfig for a group name the
	// broker refuses, and ErrNoFanOut on sqs. Nil means ErrNoFanOut.
	NewSubscriber func(group string) (message.Subscriber, error)
	// BrokerSideFields maps each metadata field the subscriber sets that describes a delivery
	// (a redelivered flag, a delivery count, an offset) to the reason it is not a message ID.
	// Pass it to inbox.Config.BrokerSideFields. inbox.MetadataKey refuses these fields
	// whatever map it is given (they come from one table per broker, internal/brokerside).
	BrokerSideFields map[string]string
	// Redelivery reads the broker's own redelivery signal from a delivered message:
	// inbox.FirstDelivery only when the broker guarantees no earlier delivery of the message
	// reached a consumer of the group, inbox.Redelivered when it says there may have been one,
	// inbox.RedeliveryUnknown when it gives no trustworthy signal. Never nil for a Broker an
	// adapter built. docs/adapters.md tabulates the signal and its worth per broker.
	Redelivery inbox.RedeliveryFunc
	// SubscribeInitialize asks package router to call SubscribeInitialize(topic) on a consumer
	// group's subscriber when a consumer is added, so the broker keeps for the group what is
	// published before the router runs (amqp: the group's queue is declared and bound).
	SubscribeInitialize bool
	// Closers run by Close after the publisher and subscriber, e.g. a connection pool the
	// adapter opened itself.
	Closers []func() error
}

// SubscriberFor returns b.NewSubscriber(group), or an error wrapping ErrNoFanOut when the
// broker has no NewSubscriber, and one wrapping inbox.ErrInvalidConfig for an empty group.
func (b *Broker) SubscriberFor(group string) (message.Subscriber, error) {
	if group == "" {
		return nil, fmt.Errorf("%w: %s adapter: empty consumer group", inbox.ErrInvalidConfig, b.Name)
	}
	if b.NewSubscriber == nil {
		return nil, fmt.Errorf("%s adapter: consumer group %q: %w", b.Name, group, ErrNoFanOut)
	}
	return b.NewSubscriber(group)
}

// UnknownRedelivery is the RedeliveryFunc of a broker without a trustworthy redelivery signal:
// it always returns inbox.RedeliveryUnknown.
func UnknownRedelivery(*message.Message) inbox.Redelivery { return inbox.RedeliveryUnknown }

// Close closes the subscriber, then the publisher, then the Closers, and returns every error
// joined.
func (b *Broker) Close() error {
	var errs []error
	if b.Subscriber != nil {
		errs = append(errs, b.Subscriber.Close())
	}
	if b.Publisher != nil {
		errs = append(errs, b.Publisher.Close())
	}
	for _, c := range b.Closers {
		errs = append(errs, c())
	}
	return errors.Join(errs...)
}
