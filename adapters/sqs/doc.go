// Package sqs is a Watermill Pub/Sub for Amazon SQS on aws-sdk-go-v2: a Publisher and a
// Subscriber whose topic is the queue name. It exists because watermill-aws is not available
// to this project, and it differs from watermill-aws where the inbox needs it to: the message
// UUID comes only from the producer's `_watermill_message_uuid` attribute and is never
// replaced by the SQS MessageId.
//
//	cfg, err := config.LoadDefaultConfig(ctx) // github.com/aws/aws-sdk-go-v2/config
//	pub, err := sqs.NewPublisher(sqs.PublisherConfig{AWSConfig: cfg}, logger)
//	sub, err := sqs.NewSubscriber(sqs.SubscriberConfig{AWSConfig: cfg, MaxInFlight: 8}, logger)
//	err = sub.SubscribeInitialize("payments")        // CreateQueue (idempotent)
//	err = pub.Publish("payments", message.NewMessage(watermill.NewUUID(), []byte(`{"amount":5}`)))
//	router.AddConsumerHandler("billing", "payments", sub, handler) // + the inbox middleware
//
// For the inbox, New builds both as an adapters.Broker (importing the package registers it
// as "sqs" for package router): its Publisher and Subscriber create a topic's queue, with
// BrokerConfig.QueueAttributes, when it does not exist yet, and it carries BrokerSideFields.
// Tests run against goaws, an in-process SQS emulator, in the module adapters/sqs/sqstest
// (kept apart so that the library's go.mod requires no emulator); goaws speaks only the query
// protocol (option QueryProtocol), Amazon SQS the SDK's default JSON protocol.
//
// What travels where:
//   - payload: the message body. SQS accepts text only (XML characters, at least one):
//     base64-encode binary payloads; Publish refuses others with ErrInvalidMessage.
//   - UUID: the String message attribute UUIDAttribute. A message that arrives without it has
//     an empty UUID, which the inbox middleware refuses as a permanent error.
//   - metadata: one String message attribute per non-empty field (SQS allows 10 attributes
//     per message, the UUID included).
//   - SQS system attributes (ReceiptHandle, MessageId, ApproximateReceiveCount...) describe a
//     delivery; BrokerSideFields lists them. Only ApproximateReceiveCount (ReceiveCountKey)
//     and, on FIFO queues, SequenceNumber (SequenceNumberKey) are copied into metadata, from
//     SQS's own values, for Redelivery; a producer's attribute of either name is dropped.
//
// Delivery is at least once. Ack deletes the message; Nack makes it visible again at once;
// while a handler runs, the subscriber extends the message's visibility every third of the
// visibility timeout, so a slow handler's message is not handed to a second consumer. At
// most SubscriberConfig.MaxInFlight messages per subscription are in flight at a time.
// Failed receives are logged and retried with exponential backoff. Payloads and credentials
// are never logged.
//
// IAM permissions: the Publisher needs sqs:GetQueueUrl and sqs:SendMessage; the Subscriber
// needs sqs:GetQueueUrl, sqs:ReceiveMessage, sqs:DeleteMessage, sqs:ChangeMessageVisibility,
// sqs:GetQueueAttributes (unless SubscriberConfig.VisibilityTimeout is set) and, for
// SubscribeInitialize, sqs:CreateQueue.
package sqs
