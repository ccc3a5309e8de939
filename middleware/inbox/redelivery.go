package inbox

import "github.com/ThreeDotsLabs/watermill/message"

// Redelivery is what a broker's own signal says about one delivery of a message: whether an
// earlier delivery of it to this consumer may have reached a handler. The inbox uses it to
// decide whether a delivery must be counted durably before its handler runs (see
// Config.Redelivery and docs/design.md, "Attempt accounting").
type Redelivery int

const (
	// RedeliveryUnknown: the broker gives no signal the inbox can trust (watermill-sql,
	// GoChannel; a Kafka record already in the log when its partition was assigned). The inbox
	// treats the delivery as a possible redelivery.
	RedeliveryUnknown Redelivery = iota
	// FirstDelivery: the broker guarantees that no earlier delivery of this message reached a
	// consumer (AMQP's redelivered flag is false; SQS's ApproximateReceiveCount is 1 on a FIFO
	// queue; a NATS JetStream delivery count of 1; a Kafka record appended after its consumer
	// was assigned the partition).
	FirstDelivery
	// Redelivered: the broker says the message may have been delivered before (AMQP's
	// redelivered flag, a delivery count above 1).
	Redelivered
)

// String returns "unknown", "first" or "redelivered".
func (r Redelivery) String() string {
	switch r {
	case FirstDelivery:
		return "first"
	case Redelivered:
		return "redelivered"
	}
	return "unknown"
}

// RedeliveryFunc reads a delivery's Redelivery from the message as the subscriber produced it
// (its broker-set metadata). Each broker adapter exports one (adapters.Broker.Redelivery); it
// must return RedeliveryUnknown whenever the broker's signal is missing or cannot be trusted.
type RedeliveryFunc func(msg *message.Message) Redelivery
