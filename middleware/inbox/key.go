package inbox

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
)

// MaxKeyBytes is the longest message key accepted, in bytes (UTF-8). It keeps the
// (message_id, consumer_name) primary key far below PostgreSQL's B-tree entry limit of about
// 2,700 bytes (a third of an 8 KiB page), beyond which an INSERT fails with SQLSTATE 54000.
const MaxKeyBytes = 512

// MaxConsumerNameBytes is the longest consumer name accepted, in bytes (UTF-8).
const MaxConsumerNameBytes = 128

// KeyExtractor returns the deduplication key of a message: the ID its producer assigned once,
// when the event was created, or a business idempotency key. It must never return a value that
// describes the delivery (a broker offset, a delivery tag, a receipt handle, a delivery counter):
// those change on redelivery and turn every redelivery into a "new" message.
//
// The middleware validates whatever an extractor returns (see ValidateKey), so an extractor may
// return an empty string and leave the refusal to the middleware.
type KeyExtractor interface {
	// ExtractKey returns the message's key, or an error that is reported as permanent.
	ExtractKey(msg *message.Message) (string, error)
	// Source names the key's origin for error messages, e.g. "message UUID".
	Source() string
}

// MessageUUID returns the default KeyExtractor: the Watermill message UUID, which every
// Watermill publisher sends with the message (the `_watermill_message_uuid` header on AMQP,
// Kafka and NATS, the `uuid` column of watermill-sql). An adapter that receives no such header
// leaves it empty, and the middleware then refuses the message with an *InvalidKeyError.
func MessageUUID() KeyExtractor { return messageUUID{} }

type messageUUID struct{}

func (messageUUID) ExtractKey(msg *message.Message) (string, error) { return msg.UUID, nil }
func (messageUUID) Source() string                                  { return "message UUID" }

// brokerSideMetadata lists metadata fields set by brokers or Watermill adapters that describe a
// delivery rather than the message. Names are compared case-insensitively.
var brokerSideMetadata = map[string]string{
	"_watermill_amqp_redelivered": "watermill-amqp sets it on every redelivery (AMQP basic.deliver redelivered flag)",
	"x-delivery-count":            "RabbitMQ quorum queues count deliveries in it",
	"x-death":                     "RabbitMQ appends to it on every dead-lettering",
	"redelivered":                 "AMQP's redelivered flag changes on redelivery",
	"delivery_tag":                "an AMQP delivery tag numbers deliveries on one channel",
	"approximatereceivecount":     "SQS increments it on every receive",
	"receipthandle":               "SQS issues a new receipt handle on every receive",
	"receipt_handle":              "SQS issues a new receipt handle on every receive",
	"offset":                      "a Kafka offset is per partition and shifts on replay into another topic",
	"partition":                   "a Kafka partition number is shared by every message on it",
	"kafka_offset":                "a Kafka offset is per partition and shifts on replay into another topic",
	"kafka_partition":             "a Kafka partition number is shared by every message on it",
	"stream_seq":                  "a stream sequence describes the broker's storage, not the message",
	"num_delivered":               "NATS JetStream counts deliveries in it",
}

// MetadataKey returns a KeyExtractor that reads the named metadata field, for producers that
// send a business idempotency key (a payment request ID, an order number) that survives their
// own retries. It returns an error wrapping ErrBrokerSideKey when field names a known
// broker-side delivery identifier (watermill-amqp's `_watermill_amqp_redelivered`,
// RabbitMQ's `x-delivery-count` and `x-death`, SQS's `ApproximateReceiveCount` and receipt
// handle, Kafka offsets and partitions, NATS delivery counts) or a field named in one of the
// brokerSide maps (field name to the reason it describes a delivery; each broker adapter
// exports its own, e.g. adapters/amqp.BrokerSideFields), and one wrapping ErrInvalidConfig
// when field is empty. Names are compared case-insensitively.
func MetadataKey(field string, brokerSide ...map[string]string) (KeyExtractor, error) {
	if strings.TrimSpace(field) == "" {
		return nil, fmt.Errorf("%w: MetadataKey: empty field name", ErrInvalidConfig)
	}
	if why, ok := brokerSideMetadata[strings.ToLower(field)]; ok {
		return nil, fmt.Errorf("%w: %q: %s", ErrBrokerSideKey, field, why)
	}
	for _, fields := range brokerSide {
		for name, why := range fields {
			if strings.EqualFold(name, field) {
				return nil, fmt.Errorf("%w: %q: %s", ErrBrokerSideKey, field, why)
			}
		}
	}
	return metadataKey{field: field}, nil
}

// IsBrokerSideField reports whether field is a known broker-side delivery identifier, by the
// built-in list or one of the brokerSide maps (see MetadataKey).
func IsBrokerSideField(field string, brokerSide ...map[string]string) bool {
	_, err := MetadataKey(field, brokerSide...)
	return errors.Is(err, ErrBrokerSideKey)
}

type metadataKey struct{ field string }

func (m metadataKey) ExtractKey(msg *message.Message) (string, error) {
	return msg.Metadata.Get(m.field), nil
}
func (m metadataKey) Source() string { return fmt.Sprintf("metadata %q", m.field) }

// ValidateKey checks a message key: non-empty and not only white space, at most MaxKeyBytes
// bytes, valid UTF-8 and free of NUL (PostgreSQL text cannot store NUL: SQLSTATE 22021). It returns nil or an
// *InvalidKeyError naming source.
func ValidateKey(source, key string) error {
	reason := ""
	switch {
	case key == "":
		reason = "empty"
	case strings.TrimSpace(key) == "":
		reason = "blank"
	case len(key) > MaxKeyBytes:
		reason = fmt.Sprintf("too long (limit %d bytes)", MaxKeyBytes)
	case !utf8.ValidString(key):
		reason = "invalid UTF-8"
	case strings.IndexByte(key, 0) >= 0:
		reason = "contains NUL"
	default:
		return nil
	}
	return &InvalidKeyError{Source: source, Reason: reason, Length: len(key)}
}

// validateConsumerName applies the key rules to a consumer name, with its own length limit.
func validateConsumerName(name string) error {
	switch {
	case strings.TrimSpace(name) == "":
		return fmt.Errorf("%w: ConsumerName is required (it is part of the inbox key, so handlers sharing a table never block each other)", ErrInvalidConfig)
	case len(name) > MaxConsumerNameBytes:
		return fmt.Errorf("%w: ConsumerName is %d bytes, limit %d", ErrInvalidConfig, len(name), MaxConsumerNameBytes)
	case !utf8.ValidString(name) || strings.IndexByte(name, 0) >= 0:
		return fmt.Errorf("%w: ConsumerName must be valid UTF-8 without NUL", ErrInvalidConfig)
	}
	return nil
}
