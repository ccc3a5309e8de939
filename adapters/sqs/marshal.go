package sqs

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

const stringType = "String"

// marshal turns a Watermill message into an SQS body and message attributes: the payload as
// the body, the UUID in UUIDAttribute, each non-empty metadata field in a String attribute of
// the same name. Empty values are left out because SQS refuses empty attribute values; on
// receive, Metadata.Get returns "" for them all the same. The error wraps ErrInvalidMessage.
func marshal(msg *message.Message) (string, map[string]types.MessageAttributeValue, error) {
	if len(msg.Payload) == 0 {
		return "", nil, fmt.Errorf("%w: message %q: empty payload (SQS requires a body of at least one character)", ErrInvalidMessage, msg.UUID)
	}
	if err := validateText(string(msg.Payload)); err != nil {
		return "", nil, fmt.Errorf("%w: message %q: payload %v", ErrInvalidMessage, msg.UUID, err)
	}
	attrs := make(map[string]types.MessageAttributeValue, len(msg.Metadata)+1)
	if msg.UUID != "" {
		if err := validateText(msg.UUID); err != nil {
			return "", nil, fmt.Errorf("%w: message UUID %v", ErrInvalidMessage, err)
		}
		attrs[UUIDAttribute] = stringAttr(msg.UUID)
	}
	keys := make([]string, 0, len(msg.Metadata))
	for k := range msg.Metadata {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := msg.Metadata[k]
		if v == "" {
			continue
		}
		if k == UUIDAttribute {
			return "", nil, fmt.Errorf("%w: message %q: metadata field %q is reserved for the message UUID", ErrInvalidMessage, msg.UUID, k)
		}
		if err := validateAttributeName(k); err != nil {
			return "", nil, fmt.Errorf("%w: message %q: metadata: %v", ErrInvalidMessage, msg.UUID, err)
		}
		if err := validateText(v); err != nil {
			return "", nil, fmt.Errorf("%w: message %q: metadata field %q: value %v", ErrInvalidMessage, msg.UUID, k, err)
		}
		attrs[k] = stringAttr(v)
	}
	if len(attrs) > MaxMessageAttributes {
		return "", nil, fmt.Errorf("%w: message %q needs %d message attributes (UUID + non-empty metadata), SQS allows %d", ErrInvalidMessage, msg.UUID, len(attrs), MaxMessageAttributes)
	}
	return string(msg.Payload), attrs, nil
}

func stringAttr(v string) types.MessageAttributeValue {
	return types.MessageAttributeValue{DataType: aws.String(stringType), StringValue: aws.String(v)}
}

// unmarshal turns a received SQS message into a Watermill message. The UUID comes from
// UUIDAttribute only (empty when it is missing); String and Number attributes (custom types
// such as "String.json" included) become metadata; Binary attributes and every SQS system
// attribute (BrokerSideFields) are left out.
func unmarshal(m types.Message) *message.Message {
	uuid := ""
	if a, ok := m.MessageAttributes[UUIDAttribute]; ok && a.StringValue != nil {
		uuid = *a.StringValue
	}
	msg := message.NewMessage(uuid, []byte(aws.ToString(m.Body)))
	for name, a := range m.MessageAttributes {
		if name == UUIDAttribute || a.StringValue == nil {
			continue
		}
		dt := aws.ToString(a.DataType)
		if strings.HasPrefix(dt, stringType) || strings.HasPrefix(dt, "Number") {
			msg.Metadata.Set(name, *a.StringValue)
		}
	}
	// Only SQS's own values: a message attribute of the same name from a producer is dropped.
	delete(msg.Metadata, ReceiveCountKey)
	delete(msg.Metadata, SequenceNumberKey)
	if v := m.Attributes[ReceiveCountKey]; v != "" {
		msg.Metadata.Set(ReceiveCountKey, v)
	}
	if v := m.Attributes[SequenceNumberKey]; v != "" {
		msg.Metadata.Set(SequenceNumberKey, v)
	}
	return msg
}

// ReceiveCountKey is the metadata field holding the SQS system attribute
// ApproximateReceiveCount of the delivery: how many times SQS handed the message out,
// this receive included ("1" on the first). A broker-side field: never a key, removed from
// dead letters.
const ReceiveCountKey = "ApproximateReceiveCount"

// SequenceNumberKey is the metadata field holding the SQS system attribute SequenceNumber, set
// by SQS on messages of FIFO queues only. A broker-side field.
const SequenceNumberKey = "SequenceNumber"

// Redelivery is the adapter's inbox.RedeliveryFunc, from ApproximateReceiveCount
// (ReceiveCountKey): above 1 it is inbox.Redelivered. A count of 1 is inbox.FirstDelivery only
// on a FIFO queue (SequenceNumberKey present), where SQS delivers each message once until its
// visibility timeout expires; on a standard queue SQS may hand out a second copy of a message
// (at-least-once delivery from redundant storage) and the count is approximate, so 1 gives
// inbox.RedeliveryUnknown. A missing or unreadable count gives inbox.RedeliveryUnknown.
//
// goaws, the emulator the tests run on, always reports 1: the Redelivered case is covered by
// tests of this function on constructed messages, not by a redelivery on goaws.
func Redelivery(msg *message.Message) inbox.Redelivery {
	n, err := strconv.ParseUint(msg.Metadata.Get(ReceiveCountKey), 10, 64)
	switch {
	case err != nil || n == 0:
		return inbox.RedeliveryUnknown
	case n > 1:
		return inbox.Redelivered
	case msg.Metadata.Get(SequenceNumberKey) != "":
		return inbox.FirstDelivery
	default:
		return inbox.RedeliveryUnknown
	}
}
