package sqs

import (
	"fmt"
	"sort"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
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
	return msg
}
