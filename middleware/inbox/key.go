package inbox

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"github.com/watermill-inbox/watermill-inbox/internal/keyrule"
)

// Limits of a message key and a consumer name, in bytes (UTF-8).
const (
	// MaxKeyBytes is the longest message key accepted. It keeps the (message_id,
	// consumer_name) primary key far below PostgreSQL's B-tree entry limit of about 2,700
	// bytes (a third of an 8 KiB page), beyond which an INSERT fails with SQLSTATE 54000.
	MaxKeyBytes = keyrule.MaxKeyBytes
	// MaxConsumerNameBytes is the longest consumer name accepted.
	MaxConsumerNameBytes = keyrule.MaxConsumerNameBytes
)

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

// MetadataKey returns a KeyExtractor that reads the named metadata field, for producers that
// send a business idempotency key (a payment request ID, an order number) that survives their
// own retries. It returns an error wrapping ErrBrokerSideKey when field names a broker-side
// delivery or storage field: one of the core's broker-neutral names (redelivered,
// delivery_count, delivery_id), a field any supported adapter documents as broker-side
// (watermill-amqp's `_watermill_amqp_redelivered`, RabbitMQ's `x-delivery-count` and
// `x-death`, Kafka's partition and offset, SQS's `ApproximateReceiveCount` and receipt handle,
// NATS delivery counts, Redis' `times_delivered`: the adapters' BrokerSideFields, whatever
// the caller passes), or a field named in one of the brokerSide maps (field name to reason,
// for fields of a custom subscriber). It returns an error wrapping ErrInvalidConfig when
// field is empty. Names are compared case-insensitively.
func MetadataKey(field string, brokerSide ...map[string]string) (KeyExtractor, error) {
	if strings.TrimSpace(field) == "" {
		return nil, fmt.Errorf("%w: MetadataKey: empty field name", ErrInvalidConfig)
	}
	if broker, why, ok := brokerside.Lookup(field); ok {
		return nil, fmt.Errorf("%w: %q (%s): %s", ErrBrokerSideKey, field, broker, why)
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

type metadataKey struct{ field string }

func (m metadataKey) ExtractKey(msg *message.Message) (string, error) {
	return msg.Metadata.Get(m.field), nil
}
func (m metadataKey) Source() string { return fmt.Sprintf("metadata %q", m.field) }

// ValidateKey checks a message key: non-empty and not only white space, at most MaxKeyBytes
// bytes, valid UTF-8 and free of NUL (PostgreSQL text cannot store NUL: SQLSTATE 22021). It
// returns nil or an *InvalidKeyError naming source.
func ValidateKey(source, key string) error {
	if reason := keyrule.Problem(key); reason != "" {
		return &InvalidKeyError{Source: source, Reason: reason, Length: len(key)}
	}
	return nil
}

// ValidateConsumerName checks a consumer name, the one rule of every package and command that
// takes one (inbox.New, the store-then-process inbox, the metrics, the CLI): not blank, at most
// MaxConsumerNameBytes bytes of valid UTF-8 without NUL, and no control character (a newline,
// an escape sequence: a name is printed as it is in logs, metric labels and the CLI, so it is
// refused rather than escaped). Errors wrap ErrInvalidConfig.
func ValidateConsumerName(name string) error {
	switch {
	case strings.TrimSpace(name) == "":
		return fmt.Errorf("%w: ConsumerName is required (it is part of the inbox key, so handlers sharing a table never block each other)", ErrInvalidConfig)
	case len(name) > MaxConsumerNameBytes:
		return fmt.Errorf("%w: ConsumerName is %d bytes, limit %d", ErrInvalidConfig, len(name), MaxConsumerNameBytes)
	case !utf8.ValidString(name) || strings.IndexByte(name, 0) >= 0:
		return fmt.Errorf("%w: ConsumerName must be valid UTF-8 without NUL", ErrInvalidConfig)
	case strings.IndexFunc(name, unicode.IsControl) >= 0:
		// Configuration, not message material: refused rather than escaped, so that it is
		// printed as it is everywhere (logs, metrics labels, the CLI).
		return fmt.Errorf("%w: ConsumerName %q contains a control character", ErrInvalidConfig, name)
	}
	return nil
}
