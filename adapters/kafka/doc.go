// Package kafka connects the inbox to Apache Kafka through watermill-kafka v3
// (github.com/ThreeDotsLabs/watermill-kafka/v3) and IBM/sarama. It builds a Watermill
// message.Publisher and a consumer-group message.Subscriber whose settings keep delivery
// at-least-once, which is what the inbox turns into exactly-once effects in PostgreSQL. New
// returns both as an adapters.Broker, with BrokerSideFields; package router builds it from
// configuration (INBOX_BROKER=kafka, INBOX_BROKER_URL=kafka://kafka-1:9092,kafka-2:9092):
//
//	cfg := kafka.Config{Brokers: []string{"kafka-1:9092"}, ConsumerGroup: "billing"}
//	b, err := kafka.New(cfg, logger)
//	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing",
//		BrokerSideFields: b.BrokerSideFields}, logger)
//	h := router.AddConsumerHandler("billing", "payments", b.Subscriber, handle)
//	h.AddMiddleware(ib.Middleware)
//
// Topics must exist or be created by the brokers on first use (see New); package kafkatest's
// cluster creates them with kafkatest.DefaultPartitions partitions.
//
// # Message ID
//
// watermill-kafka's DefaultMarshaler sends the Watermill message UUID (the producer's ID) in the
// record header `_watermill_message_uuid` and copies every other metadata entry to a header of
// the same name; on the consumer side the header becomes msg.UUID, which is the inbox's default
// key (inbox.MessageUUID). A record without that header (written by a non-Watermill producer)
// arrives with an empty UUID, which the inbox refuses as a permanent *inbox.InvalidKeyError.
//
// Kafka's own coordinates of a record (partition, offset, timestamp, record key) describe
// where and when it was stored, not which message it is; see BrokerSideFields. Never build an
// inbox key from them: the same offset exists on every partition, and a replay into another
// topic or partition renumbers everything. For a business key in a metadata field use
// inbox.MetadataKey(field, kafka.BrokerSideFields), which refuses these names.
//
// # At-least-once, as watermill-kafka v3.0.6 implements it
//
// Read from pkg/kafka/subscriber.go of v3.0.6. Per claimed partition, one goroutine
// (sarama's ConsumeClaim) hands one message at a time to the router and waits for its Ack or
// Nack before it reads the next; partitions run concurrently, so a subscriber processes up to
// one message per assigned partition at a time.
//
//   - Ack: the record is marked (sarama MarkMessage, offset+1), but only if the consumer-group
//     session is still alive; after a rebalance took the partition away it is not marked, and
//     the new owner receives it again (the inbox skips it as a duplicate). Marked offsets are
//     committed by sarama's auto-commit every CommitInterval, or synchronously after every
//     ack with CommitEveryAck. Sarama commits only marked offsets, so no offset is committed
//     before its message was acked; records prefetched into sarama's channel buffer are never
//     committed on a rebalance.
//   - Nack: the same record is re-sent to the router after NackResendSleep, in place: the
//     partition waits behind it. A permanent error (an invalid key, inbox.Permanent) is retried
//     forever unless Watermill's middleware.PoisonQueueWithFilter(pub, topic, inbox.IsPermanent)
//     runs outside the inbox.
//   - Shutdown (router Close, subscriber Close) before the ack: the record is not marked and is
//     delivered again after the restart.
//   - A crash loses at most the marks of acked records whose offsets were not committed yet
//     (up to CommitInterval of them; none with CommitEveryAck): they are delivered again and
//     the inbox skips them.
//   - An unmarshal error ends the partition's claim (watermill-kafka returns it from
//     ConsumeClaim and sarama stops that partition until the next rebalance, which starts it
//     again at the same record); the DefaultMarshaler never fails.
//
// # Redelivery signal
//
// Redelivery (the Broker's Redelivery) reads FirstDelivery for a record appended after the
// consuming session was assigned its partition, RedeliveryUnknown for every other delivery
// (records already in the log then, a nacked record's re-send); signal.go gives the reasoning
// and docs/adapters.md ("Kafka's first-delivery signal") the rule, the lease that keeps a
// member removed from the group from reading FirstDelivery, and the cases where it is off.
//
// The processing order is per partition. Messages that must be applied in order (all payments
// of one account) must share a partition: set Config.PartitionKey.
package kafka
