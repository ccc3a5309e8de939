// Package brokerside holds, per supported broker, the metadata fields that describe a delivery
// or the broker's storage rather than the message: never an inbox key. It is a leaf package:
// each adapter package exports its broker's table as its BrokerSideFields (the adapters own
// the lists: edit a broker's table here together with its adapter), and package inbox consults
// every table, so inbox.MetadataKey refuses a broker-side field of any supported broker
// whatever map the caller passed.
package brokerside

import "strings"

// AMQP: the headers and metadata RabbitMQ and watermill-amqp attach to a delivery.
var AMQP = map[string]string{

	"_watermill_amqp_redelivered": "watermill-amqp sets it when RabbitMQ flags a redelivery (basic.deliver redelivered)",
	"x-delivery-count":            "RabbitMQ quorum queues count deliveries in it",
	"x-death":                     "RabbitMQ appends to it on every dead-lettering",
	"x-first-death-queue":         "RabbitMQ sets it when a message is first dead-lettered",
	"x-first-death-reason":        "RabbitMQ sets it when a message is first dead-lettered",
	"x-first-death-exchange":      "RabbitMQ sets it when a message is first dead-lettered",
	"x-last-death-queue":          "RabbitMQ sets it on every dead-lettering",
	"x-last-death-reason":         "RabbitMQ sets it on every dead-lettering",
	"x-last-death-exchange":       "RabbitMQ sets it on every dead-lettering", "redelivered": "AMQP's basic.deliver redelivered flag changes on redelivery",
	"delivery_tag": "an AMQP delivery tag numbers deliveries on one channel",
}

// Kafka: the names of the values watermill-kafka v3 exposes about a consumed record (in the
// message context, not metadata) and of its log fields, the names a metadata field copying
// them would likely get.
var Kafka = map[string]string{

	"partition":              "a Kafka partition number is shared by every record of the partition (MessagePartitionFromCtx)",
	"kafka_partition":        "a Kafka partition number is shared by every record of the partition (watermill-kafka log field)",
	"offset":                 "a Kafka offset is numbered per partition: the same offset exists on every partition, and a replay into another topic renumbers it",
	"partition_offset":       "a Kafka offset is numbered per partition: the same offset exists on every partition, and a replay into another topic renumbers it (MessagePartitionOffsetFromCtx)",
	"kafka_offset":           "a Kafka offset is numbered per partition: the same offset exists on every partition, and a replay into another topic renumbers it",
	"kafka_partition_offset": "a Kafka offset is numbered per partition: the same offset exists on every partition, and a replay into another topic renumbers it (watermill-kafka log field)",
	"kafka_initial_offset":   "the offset a consumer-group claim started at describes one session of one consumer (watermill-kafka log field)",
	"timestamp":              "a Kafka record timestamp has millisecond precision and is set by the producer or, with LogAppendTime, by the broker on every append: distinct messages share it and a re-published copy gets a new one (MessageTimestampFromCtx)",
	"kafka_timestamp":        "a Kafka record timestamp has millisecond precision and is set by the producer or, with LogAppendTime, by the broker on every append: distinct messages share it and a re-published copy gets a new one",
	"key":                    "a Kafka record key is a partitioning key shared by every message of one entity (an account, an order), not unique per message (MessageKeyFromCtx)",
	"kafka_key":              "a Kafka record key is a partitioning key shared by every message of one entity (an account, an order), not unique per message"}

// SQS: the system attributes SQS attaches to a delivery rather than to the message.
var SQS = map[string]string{

	"ReceiptHandle":                    "SQS issues a new receipt handle on every receive",
	"ApproximateReceiveCount":          "SQS increments it on every receive",
	"ApproximateFirstReceiveTimestamp": "it records when the first receive happened, not what the message is",
	"MessageId":                        "SQS assigns a new MessageId on every SendMessage, so a producer's retry of the same event gets a new one",
	"SequenceNumber":                   "SQS numbers FIFO messages on every SendMessage, so a producer's retry gets a new number",
	"SentTimestamp":                    "it records when SQS accepted this send; a producer's retry gets a new one, and messages sent in the same millisecond share it",
	"SenderId":                         "it identifies the sending IAM principal, shared by every message that principal sends",
	"MessageGroupId":                   "a FIFO message group is shared by every message of the group",
	"DeadLetterQueueSourceArn":         "it names the queue a dead-lettered message came from, shared by every message moved from it",
	"AWSTraceHeader":                   "it carries the X-Ray trace of the send, not the identity of the event", "receipt_handle": "SQS issues a new receipt handle on every receive",
}

// NATS: JetStream's delivery state and the Nats-* headers the server writes.
var NATS = map[string]string{

	"num_delivered":      "JetStream counts deliveries of the message in it (ack metadata)",
	"num_pending":        "JetStream reports the consumer's backlog in it (ack metadata)",
	"stream_seq":         "a stream sequence describes the broker's storage, not the message",
	"consumer_seq":       "a consumer sequence numbers deliveries, redeliveries included",
	"Nats-Stream":        "set by the server on a republished or directly fetched message",
	"Nats-Subject":       "set by the server on a republished or directly fetched message",
	"Nats-Sequence":      "the stream sequence, set by the server on a republished or directly fetched message",
	"Nats-Last-Sequence": "set by the server on a republished message",
	"Nats-Time-Stamp":    "the storage time, set by the server on a republished or directly fetched message",
	"Nats-Stream-Source": "set by the server on a message sourced from another stream",
	"Nats-Num-Pending":   "set by the server on a directly fetched message",
	"Nats-Msg-Size":      "set by the server on a headers-only delivery"}

// Redis: Redis Streams' delivery state.
var Redis = map[string]string{

	"xid":                         "a Redis stream entry ID describes the stream's storage; a republished message gets a new one",
	"times_delivered":             "the consumer group's pending list counts deliveries in it (XPENDING)",
	"_watermill_inbox_redis_read": "adapters/redis marks each message it reads from Redis, for its redelivery signal"}

// Postgres: watermill-sql sets no delivery metadata; its offsets stay internal.
var Postgres = map[string]string{}

// Delivered lists the fields an adapter of this module actually writes into message metadata
// on delivery (the others are names a custom unmarshaler might use). They are removed from
// dead letters whatever the broker (inbox.IsBrokerSideField).
var Delivered = []string{
	"_watermill_amqp_redelivered", // watermill-amqp, on a redelivery
	"x-delivery-count",            // adapters/amqp, from a quorum queue's header
	"x-death",                     // adapters/amqp, when RabbitMQ dead-lettered the message
	"num_delivered",               // adapters/nats, JetStream's delivery count
	"ApproximateReceiveCount",     // adapters/sqs, SQS's receive count
	"SequenceNumber",              // adapters/sqs, on FIFO queues
	"_watermill_inbox_redis_read", // adapters/redis, on every read (its redelivery signal)
}

// Tables are every broker's table, by adapter name.
var Tables = map[string]map[string]string{
	"amqp": AMQP, "kafka": Kafka, "sqs": SQS, "nats": NATS, "redis": Redis, "postgres": Postgres,
}

// Neutral is the core's own list: broker-neutral names of delivery state, refused as keys and
// removed from dead letters whatever the broker.
var Neutral = map[string]string{
	"redelivered":    "a redelivered flag describes one delivery and changes on redelivery",
	"delivery_count": "a delivery count changes on every redelivery",
	"delivery_id":    "a delivery ID names one delivery, not the message",
}

// Lookup reports whether field (compared case-insensitively) is in Neutral or in any broker's
// table, with the broker's name ("any broker" for Neutral) and the reason.
func Lookup(field string) (broker, reason string, ok bool) {
	if why, ok := Neutral[strings.ToLower(field)]; ok {
		return "any broker", why, true
	}
	for _, b := range []string{"amqp", "kafka", "sqs", "nats", "redis", "postgres"} {
		for name, why := range Tables[b] {
			if strings.EqualFold(name, field) {
				return b, why, true
			}
		}
	}
	return "", "", false
}

// IsDelivered reports whether field (case-insensitively) is one of Delivered.
func IsDelivered(field string) bool {
	for _, name := range Delivered {
		if strings.EqualFold(name, field) {
			return true
		}
	}
	return false
}

// IsDeliveryState reports whether field is delivery state to remove from a dead letter: a
// Neutral name, a field an adapter of this module writes into metadata on delivery
// (Delivered), or a field of one of the extra maps (an adapter's BrokerSideFields, a custom
// subscriber's). Names a broker merely reserves (Kafka's "key" or "timestamp") are not
// removed unless a map names them.
func IsDeliveryState(field string, extra ...map[string]string) bool {
	if _, ok := Neutral[strings.ToLower(field)]; ok || IsDelivered(field) {
		return true
	}
	for _, fields := range extra {
		for name := range fields {
			if strings.EqualFold(name, field) {
				return true
			}
		}
	}
	return false
}
