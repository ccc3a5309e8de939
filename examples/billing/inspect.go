//go:build unix

package main

// The orchestrator's side of the broker: the same router configuration the consumers read
// from their environment, the in-process Kafka and SQS it starts, and what verifying a run
// needs beyond the adapters (what the broker still holds, deleting a run's queues and streams).

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/jackc/pgx/v5/pgxpool"
	natsgo "github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	goredis "github.com/redis/go-redis/v9"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkafake"
	"github.com/watermill-inbox/watermill-inbox/adapters/nats"
	"github.com/watermill-inbox/watermill-inbox/adapters/postgres"
	"github.com/watermill-inbox/watermill-inbox/adapters/redis"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs/sqstest/sqsfake"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/router"
)

const (
	// deadLetterReaderGroup is the consumer group the orchestrator reads the dead letters with.
	deadLetterReaderGroup = "dead_letter_reader"
	// publishBatch is the number of payments per Publish call.
	publishBatch = 250
)

// topics are the broker topics of one run, all on the same broker.
type topics struct {
	// payments is consumed by the billing handler.
	payments string
	// deadLetters receives the poison payments, from the billing inbox.
	deadLetters string
	// receipts receives the receipts, from the outbox relay; the receipts handler consumes it.
	receipts string
}

func (t topics) all() []string { return []string{t.payments, t.deadLetters, t.receipts} }

// runTopics names the topics. The postgres adapter stores topic "payments" in the unqualified
// table "watermill_payments" (offsets in "watermill_offsets_payments"), which the pools'
// search_path places in the run's own schema. RabbitMQ queues are global, so they carry the
// run's ID, and so do Kafka topics, SQS queues, NATS streams and Redis stream keys.
func runTopics(broker, runID string) topics {
	prefix := ""
	if broker != postgres.Name {
		prefix = "billing_demo_" + runID + "_"
	}
	return topics{payments: prefix + "payments", deadLetters: prefix + "payments_dead_letters", receipts: prefix + "receipts"}
}

// deadLetter is a message read from the dead-letter topic.
type deadLetter struct {
	UUID string
	// Attempts is the inbox's inbox_attempts metadata: the attempts counted for the message.
	Attempts string
}

// brokerAdmin is the orchestrator's access to the run's broker.
type brokerAdmin struct {
	cfg    router.Config
	pool   *pgxpool.Pool
	b      *adapters.Broker // consumer group consumerName, like the consumers'
	topics topics
	// env is what a consumer process needs to build the same broker with router.ConfigFromEnv.
	env []string
	// pending counts what the broker still holds for the billing consumer group.
	pending        func(ctx context.Context) (int64, error)
	pendingMeaning string
	cleanup        func(ctx context.Context) error
	closers        []func()
}

// newBrokerAdmin starts Kafka (kfake) or SQS (goaws) in process for those brokers, and builds
// the broker with package router, with the demo's settings.
func newBrokerAdmin(o options, pool *pgxpool.Pool, schema string, t topics) (*brokerAdmin, error) {
	a := &brokerAdmin{pool: pool, topics: t, cleanup: func(context.Context) error { return nil }}
	a.cfg = router.Config{Broker: o.broker}
	if err := a.connect(schema); err != nil {
		a.Close()
		return nil, err
	}
	a.cfg = withDemoSettings(a.cfg, o)
	// The payments are published before the consumers first subscribe: on RabbitMQ the
	// publisher declares the billing consumer group's queue first, so they are kept for it.
	a.cfg.Settings[amqp.Name].(*amqp.Config).DeclareGroups = []string{consumerName}
	b, err := router.NewBroker(a.cfg, pool, watermill.NopLogger{})
	if err != nil {
		a.Close()
		return nil, fmt.Errorf("%s broker: %w", o.broker, err)
	}
	a.b = b
	a.closers = append(a.closers, func() { _ = b.Close() })
	// On RabbitMQ the dead-letter reader's queue must be bound to the topic's exchange before
	// the first dead letter, or the dead letters land in the unrouted queue instead. (The other
	// brokers keep the topic for a consumer group that subscribes later.)
	if sub, err := a.deadLetterSubscriber(); err == nil && a.cfg.Broker == amqp.Name {
		if si, ok := sub.(message.SubscribeInitializer); ok {
			if err := si.SubscribeInitialize(t.deadLetters); err != nil {
				a.Close()
				return nil, fmt.Errorf("declare the dead-letter reader's subscription: %w", err)
			}
		}
		a.closers = append(a.closers, func() { _ = sub.Close() })
	}
	a.env = append(a.env, "INBOX_BROKER="+a.cfg.Broker, "INBOX_BROKER_URL="+a.cfg.URL)
	return a, nil
}

// connect sets the broker's URL, starts the in-process broker of kafka and sqs, and sets up
// pending and cleanup.
func (a *brokerAdmin) connect(schema string) error {
	t := a.topics
	switch a.cfg.Broker {
	case postgres.Name:
		msgs, offsets := qualified(schema, "watermill_"+t.payments), qualified(schema, "watermill_offsets_"+t.payments)
		a.pending = func(ctx context.Context) (n int64, err error) {
			err = a.pool.QueryRow(ctx, `SELECT count(*) FROM `+msgs+` m WHERE NOT EXISTS (
				SELECT 1 FROM `+offsets+` o WHERE o.consumer_group = $1
				  AND (m.transaction_id, m."offset") <= (o.last_processed_transaction_id, o.offset_acked))`, consumerName).Scan(&n)
			return n, err
		}
		a.pendingMeaning = "rows after the consumer group's committed offset"
		// The tables go with the schema.
	case amqp.Name:
		a.cfg.URL = envOr("INBOX_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
		conn, err := amqp091.Dial(a.cfg.URL)
		if err != nil {
			return fmt.Errorf("RabbitMQ is not reachable at %s: %w", redactURL(a.cfg.URL), err)
		}
		a.closers = append(a.closers, func() { _ = conn.Close() })
		// A failed operation closes its channel: one channel per operation.
		onChannel := func(f func(ch *amqp091.Channel) error) error {
			ch, err := conn.Channel()
			if err != nil {
				return fmt.Errorf("open AMQP channel: %w", err)
			}
			defer ch.Close()
			return f(ch)
		}
		a.pending = func(context.Context) (n int64, err error) {
			err = onChannel(func(ch *amqp091.Channel) error {
				q, err := ch.QueueDeclarePassive(amqp.QueueName(t.payments, consumerName), true, false, false, false, nil)
				n = int64(q.Messages)
				return err
			})
			return n, err
		}
		a.pendingMeaning = "ready messages in queue " + amqp.QueueName(t.payments, consumerName)
		a.cleanup = func(context.Context) error {
			// Every consumer group's queue of every topic, and the topics' exchanges; a
			// queue or exchange that was never declared is no error.
			var errs []error
			for _, topic := range t.all() {
				for _, group := range []string{"", consumerName, receiptsConsumerName, deadLetterReaderGroup} {
					_ = onChannel(func(ch *amqp091.Channel) error {
						_, err := ch.QueueDelete(amqp.QueueName(topic, group), false, false, false)
						return err
					})
				}
				errs = append(errs, onChannel(func(ch *amqp091.Channel) error {
					return ch.ExchangeDelete(topic, false, false)
				}))
			}
			return errors.Join(errs...)
		}
	case kafka.Name:
		addrs, stop, err := kafkafake.Start() // topics are created on first use, 4 partitions
		if err != nil {
			return err
		}
		a.closers = append(a.closers, stop) // the cluster lives in this process and goes with it
		a.cfg.URL = "kafka://" + strings.Join(addrs, ",")
		a.pending = func(context.Context) (int64, error) { return kafkaLag(addrs, consumerName, t.payments) }
		a.pendingMeaning = "records of topic " + t.payments + " after consumer group " + consumerName + "'s committed offsets"
	case sqs.Name:
		endpoint, stop, err := sqsfake.Start()
		if err != nil {
			return err
		}
		a.closers = append(a.closers, stop) // goaws lives in this process and goes with it
		a.cfg.URL, a.cfg.SQSQueryProtocol = endpoint, true
		// goaws checks no signature: any static credentials do. The consumers get the same
		// environment, where the AWS SDK's default resolution finds them.
		for k, v := range map[string]string{"AWS_REGION": sqsfake.Region, "AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo", "AWS_EC2_METADATA_DISABLED": "true"} {
			_ = os.Setenv(k, v)
			a.env = append(a.env, k+"="+v)
		}
		a.env = append(a.env, "INBOX_SQS_QUERY_PROTOCOL=true")
		client := sqsfake.Client()
		a.pending = func(ctx context.Context) (int64, error) { return sqsPending(ctx, client, t.payments) }
		a.pendingMeaning = "messages in queue " + t.payments + ", visible or in flight"
	case nats.Name:
		a.cfg.URL = envOr("INBOX_NATS_URL", "nats://127.0.0.1:4222")
		nc, err := natsgo.Connect(a.cfg.URL, natsgo.Name("billing-demo-orchestrator"))
		if err != nil {
			return fmt.Errorf("NATS is not reachable at %s: %w", redactURL(a.cfg.URL), err)
		}
		a.closers = append(a.closers, nc.Close)
		js, err := nc.JetStream()
		if err != nil {
			return fmt.Errorf("JetStream: %w", err)
		}
		a.pending = func(context.Context) (int64, error) {
			ci, err := js.ConsumerInfo(t.payments, consumerName)
			if err != nil {
				return 0, fmt.Errorf("consumer info: %w", err)
			}
			return int64(ci.NumPending) + int64(ci.NumAckPending), nil
		}
		a.pendingMeaning = "messages of stream " + t.payments + " the durable consumer has not delivered or not seen acked (JetStream NumPending + NumAckPending)"
		a.cleanup = func(context.Context) error {
			var errs []error
			for _, stream := range t.all() {
				errs = append(errs, js.DeleteStream(stream))
			}
			return errors.Join(errs...)
		}
	case redis.Name:
		a.cfg.URL = envOr("INBOX_REDIS_URL", "redis://127.0.0.1:6379")
		opts, err := goredis.ParseURL(a.cfg.URL)
		if err != nil {
			return fmt.Errorf("parse INBOX_REDIS_URL %s: %w", redactURL(a.cfg.URL), redact.Err(err, a.cfg.URL))
		}
		rc := goredis.NewClient(opts)
		a.closers = append(a.closers, func() { _ = rc.Close() })
		a.pending = func(ctx context.Context) (int64, error) {
			groups, err := rc.XInfoGroups(ctx, t.payments).Result()
			if err != nil {
				return 0, fmt.Errorf("XINFO GROUPS %s: %w", t.payments, err)
			}
			for _, g := range groups {
				if g.Name == consumerName {
					return g.Pending + g.Lag, nil
				}
			}
			return rc.XLen(ctx, t.payments).Result()
		}
		a.pendingMeaning = "entries of stream " + t.payments + " pending or not yet read in consumer group " + consumerName + " (XINFO GROUPS pending + lag)"
		a.cleanup = func(ctx context.Context) error { return rc.Del(ctx, t.all()...).Err() }
	}
	return nil
}

// createTopics creates the run's topics (tables, queues, streams and the billing group's
// consumers) before anything is published: the dead-letter topic is then there to be read,
// and the pending count to be taken. kfake creates Kafka topics on first use.
func (a *brokerAdmin) createTopics() error {
	si, ok := a.b.Subscriber.(message.SubscribeInitializer)
	if !ok || a.cfg.Broker == kafka.Name {
		return nil
	}
	for _, topic := range a.topics.all() {
		if err := si.SubscribeInitialize(topic); err != nil {
			return fmt.Errorf("create topic %s: %w", topic, err)
		}
	}
	return nil
}

// Publish sends msgs to the payments topic, in order, in batches.
func (a *brokerAdmin) Publish(msgs []*message.Message) error {
	for start := 0; start < len(msgs); start += publishBatch {
		end := min(start+publishBatch, len(msgs))
		if err := a.b.Publisher.Publish(a.topics.payments, msgs[start:end]...); err != nil {
			return fmt.Errorf("publish messages %d..%d: %w", start, end-1, err)
		}
	}
	return nil
}

// Pending returns how many payment deliveries the broker still holds for the consumer.
func (a *brokerAdmin) Pending(ctx context.Context) (int64, error) { return a.pending(ctx) }

// deadLetterSubscriber returns a new subscriber in the dead-letter reader's consumer group, or
// on a broker without consumer groups (sqs: one queue per topic) a new default subscriber.
func (a *brokerAdmin) deadLetterSubscriber() (message.Subscriber, error) {
	sub, err := a.b.SubscriberFor(deadLetterReaderGroup)
	if errors.Is(err, adapters.ErrNoFanOut) {
		b, err := router.NewBroker(a.cfg, a.pool, watermill.NopLogger{})
		if err != nil {
			return nil, err
		}
		return b.Subscriber, nil
	}
	return sub, err
}

// DeadLetters subscribes to the dead-letter topic in a consumer group of its own (on queues:
// takes the messages off the queue) and reads until want messages arrived and none more for a
// second, or none at all for 15 s.
func (a *brokerAdmin) DeadLetters(ctx context.Context, want int) ([]deadLetter, error) {
	sub, err := a.deadLetterSubscriber()
	if err != nil {
		return nil, err
	}
	defer sub.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msgs, err := sub.Subscribe(ctx, a.topics.deadLetters)
	if err != nil {
		return nil, fmt.Errorf("subscribe to %s: %w", a.topics.deadLetters, err)
	}
	var dls []deadLetter
	for {
		quiet := 15 * time.Second
		if len(dls) >= want {
			quiet = time.Second
		}
		select {
		case msg, ok := <-msgs:
			if !ok {
				return nil, errors.New("dead-letter subscription closed")
			}
			dls = append(dls, deadLetter{UUID: msg.UUID, Attempts: msg.Metadata.Get(inbox.DeadLetterAttemptsKey)})
			msg.Ack()
		case <-time.After(quiet):
			return dls, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Cleanup deletes the broker-side state of the run that the schema drop does not cover.
func (a *brokerAdmin) Cleanup(ctx context.Context) error { return a.cleanup(ctx) }

// Close closes the broker, the clients and the in-process broker, last opened first.
func (a *brokerAdmin) Close() {
	for i := len(a.closers) - 1; i >= 0; i-- {
		a.closers[i]()
	}
}

// kafkaLag sums, over the partitions of topic, the records after group's committed offset.
func kafkaLag(addrs []string, group, topic string) (int64, error) {
	committed, err := kafkafake.TryCommittedOffsets(addrs, group, topic)
	if err != nil {
		return 0, err
	}
	cfg := sarama.NewConfig()
	cfg.ClientID = "billing-demo"
	client, err := sarama.NewClient(addrs, cfg)
	if err != nil {
		return 0, err
	}
	defer func() { _ = client.Close() }()
	parts, err := client.Partitions(topic)
	if err != nil {
		return 0, err
	}
	var lag int64
	for _, p := range parts {
		end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			return 0, err
		}
		lag += end - committed[p] // no committed offset: 0, the group starts at the oldest
	}
	return lag, nil
}

// sqsPending returns the queue's visible and in-flight messages.
func sqsPending(ctx context.Context, client *awssqs.Client, queue string) (int64, error) {
	u, err := client.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(queue)})
	if err != nil {
		return 0, err
	}
	names := []sqstypes.QueueAttributeName{sqstypes.QueueAttributeNameApproximateNumberOfMessages, sqstypes.QueueAttributeNameApproximateNumberOfMessagesNotVisible}
	out, err := client.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{QueueUrl: u.QueueUrl, AttributeNames: names})
	if err != nil {
		return 0, err
	}
	var n int64
	for _, k := range names {
		var v int64
		_, _ = fmt.Sscan(out.Attributes[string(k)], &v)
		n += v
	}
	return n, nil
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}
