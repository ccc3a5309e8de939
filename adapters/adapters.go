// Package adapters holds one package per message broker. Each builds a Watermill Publisher
// and Subscriber from its configuration and declares which metadata fields its broker sets to
// describe a delivery (never a message ID). Package router picks one by configuration, so a
// handler moves from one broker to another without a code change; package adaptertest is the
// guarantee matrix every adapter passes.
package adapters

import (
	"errors"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Broker is one broker's Watermill Publisher and Subscriber, built by an adapter package.
type Broker struct {
	// Name is the adapter's name: "postgres", "amqp", "kafka", "sqs", "nats" or "redis".
	Name string
	// Publisher publishes to the broker's topics.
	Publisher message.Publisher
	// Subscriber consumes them; its consumer group (queue, consumer group, durable name) is
	// fixed by the adapter's configuration.
	Subscriber message.Subscriber
	// BrokerSideFields maps each metadata field the subscriber sets that describes a delivery
	// (a redelivered flag, a delivery count, an offset) to the reason it is not a message ID.
	// Pass it to inbox.MetadataKey and inbox.Config.BrokerSideFields.
	BrokerSideFields map[string]string
	// Closers run by Close after the publisher and subscriber, e.g. a connection pool the
	// adapter opened itself.
	Closers []func() error
}

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
