package sqs

import (
	"errors"
	"fmt"
	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"strings"
	"unicode/utf8"
)

// UUIDAttribute is the message attribute (String type) that carries the producer's Watermill
// message UUID, the same name watermill-amqp, watermill-kafka and watermill-nats use for their
// header. On receive the message UUID is read from it and from nothing else: a message without
// it arrives with an empty UUID, which the inbox refuses as a permanent error. The SQS
// MessageId is never used instead, because SQS assigns a new one on every SendMessage, so a
// producer's retry would look like a new message.
const UUIDAttribute = "_watermill_message_uuid"

// FIFOSuffix ends the name of every SQS FIFO queue.
const FIFOSuffix = ".fifo"

// ErrInvalidQueueName is wrapped by the error ValidateQueueName returns, and so by Publish,
// Subscribe and SubscribeInitialize for a topic that is not a valid SQS queue name.
var ErrInvalidQueueName = errors.New("sqs: invalid queue name")

// ErrInvalidMessage is wrapped by the error Publish returns for a message SQS would refuse:
// an empty payload, a payload with characters outside SQS's allowed set, too many attributes,
// or an invalid attribute name. Nothing of the failing message is sent.
var ErrInvalidMessage = errors.New("sqs: message cannot be sent to SQS")

// ValidateQueueName checks a topic against SQS's queue-name rules: 1 to 80 characters of
// ASCII letters, digits, hyphens and underscores, and for a FIFO queue the suffix ".fifo"
// (counted in the 80). It returns nil or an error wrapping ErrInvalidQueueName.
func ValidateQueueName(name string) error {
	base := strings.TrimSuffix(name, FIFOSuffix)
	switch {
	case base == "":
		return fmt.Errorf("%w: %q is empty", ErrInvalidQueueName, name)
	case len(name) > MaxQueueNameLength:
		return fmt.Errorf("%w: %q is %d characters, limit %d", ErrInvalidQueueName, name, len(name), MaxQueueNameLength)
	}
	for _, r := range base {
		if !isAlnum(r) && r != '-' && r != '_' {
			return fmt.Errorf("%w: %q contains %q; allowed are letters, digits, '-', '_' and the suffix %q", ErrInvalidQueueName, name, r, FIFOSuffix)
		}
	}
	return nil
}

// IsFIFO reports whether queue names a FIFO queue (its name ends in ".fifo").
func IsFIFO(queue string) bool { return strings.HasSuffix(queue, FIFOSuffix) }

// validateAttributeName applies SQS's message attribute name rules: 1 to 256 characters of
// letters, digits, '-', '_' and '.', no leading or trailing '.', no "..", and no "AWS." or
// "Amazon." prefix in any case.
func validateAttributeName(name string) error {
	lower := strings.ToLower(name)
	switch {
	case name == "":
		return errors.New("empty attribute name")
	case len(name) > MaxAttributeNameLength:
		return fmt.Errorf("attribute name is %d characters, limit %d", len(name), MaxAttributeNameLength)
	case strings.HasPrefix(lower, "aws.") || strings.HasPrefix(lower, "amazon."):
		return fmt.Errorf("attribute name %q uses a prefix SQS reserves (AWS., Amazon.)", name)
	case name[0] == '.' || name[len(name)-1] == '.' || strings.Contains(name, ".."):
		return fmt.Errorf("attribute name %q starts or ends with '.' or contains \"..\"", name)
	}
	for _, r := range name {
		if !isAlnum(r) && r != '-' && r != '_' && r != '.' {
			return fmt.Errorf("attribute name %q contains %q; allowed are letters, digits, '-', '_' and '.'", name, r)
		}
	}
	return nil
}

// validateText applies SQS's rules for a message body and a String attribute value: valid
// UTF-8 with only the characters #x9, #xA, #xD, #x20 to #xD7FF, #xE000 to #xFFFD and #x10000
// to #x10FFFF (the XML character set). Binary data must be encoded (e.g. base64) by the
// producer.
func validateText(text string) error {
	if !utf8.ValidString(text) {
		return errors.New("not valid UTF-8 (SQS accepts text only; base64-encode binary data)")
	}
	for i, r := range text {
		if r == 0x9 || r == 0xA || r == 0xD || (r >= 0x20 && r <= 0xD7FF) ||
			(r >= 0xE000 && r <= 0xFFFD) || (r >= 0x10000 && r <= 0x10FFFF) {
			continue
		}
		return fmt.Errorf("contains character %U at byte %d, outside the set SQS accepts (base64-encode binary data)", r, i)
	}
	return nil
}

func isAlnum(r rune) bool {
	return (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9')
}

// BrokerSideFields (the table internal/brokerside.SQS) names the fields SQS attaches to a delivery rather than to the message,
// mapped to the reason each one describes the delivery. This adapter puts only
// ApproximateReceiveCount and SequenceNumber into Watermill metadata (ReceiveCountKey,
// SequenceNumberKey, for Redelivery), but a custom unmarshaler or a user's own code might put
// others: none of them may serve as
// an inbox key, because each either changes on redelivery or is not unique per message. Use
// it with inbox.MetadataKey's refusal list, which compares names case-insensitively.
var BrokerSideFields = brokerside.SQS
