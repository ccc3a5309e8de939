//go:build unix

package main

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
	natsgo "github.com/nats-io/nats.go"
	goredis "github.com/redis/go-redis/v9"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkafake"
	"github.com/watermill-inbox/watermill-inbox/adapters/nats"
	"github.com/watermill-inbox/watermill-inbox/adapters/redis"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs/sqstest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// The brokers besides watermill-sql and RabbitMQ are built by their adapter packages
// (adapters/kafka, sqs, nats, redis: the ones package router picks by name), with the demo's
// timings: a delivery that a killed consumer held is redelivered after redeliverAfter instead
// of the adapters' production defaults (30 s and more).
const (
	brokerKafka = "kafka"
	brokerSQS   = "sqs"
	brokerNATS  = "nats"
	brokerRedis = "redis"

	defaultNATSURL  = "nats://127.0.0.1:4222"
	defaultRedisURL = "redis://127.0.0.1:6379"

	// envKafkaBrokers passes the orchestrator's in-process kfake cluster to the consumers.
	envKafkaBrokers = "INBOX_KAFKA_BROKERS"

	// redeliverAfter is NATS's AckWait, Redis's MaxIdleTime and SQS's VisibilityTimeout: how
	// long a delivery held by a killed consumer waits before it is handed out again.
	redeliverAfter = 3 * time.Second
	// adapterConcurrency is the concurrent deliveries of one consumer's payments on NATS
	// (SubscribersCount) and SQS (MaxInFlight); Kafka has one per partition
	// (kafkafake.DefaultPartitions); Redis one per subscription.
	adapterConcurrency = 4
	// deadLetterReaderGroup is the consumer group the orchestrator reads the dead letters with.
	deadLetterReaderGroup = "dead_letter_reader"
)

// allBrokers lists the -broker values.
var allBrokers = []string{brokerPostgres, brokerAMQP, brokerKafka, brokerSQS, brokerNATS, brokerRedis}

// isAdapterBroker reports whether broker is built by newAdapterBroker.
func isAdapterBroker(broker string) bool {
	switch broker {
	case brokerKafka, brokerSQS, brokerNATS, brokerRedis:
		return true
	}
	return false
}

func natsURL() string  { return envOr("INBOX_NATS_URL", defaultNATSURL) }
func redisURL() string { return envOr("INBOX_REDIS_URL", defaultRedisURL) }
func kafkaAddrs() []string {
	return strings.Split(os.Getenv(envKafkaBrokers), ",")
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// newAdapterBroker builds the publisher and a subscriber in consumer group group (Kafka,
// NATS, Redis; on SQS the queue, i.e. the topic, is the group).
func newAdapterBroker(broker, group string, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	switch broker {
	case brokerKafka:
		if os.Getenv(envKafkaBrokers) == "" {
			return nil, errors.New(envKafkaBrokers + " is not set: the orchestrator starts the kfake cluster")
		}
		return kafka.New(kafka.Config{
			Brokers:           kafkaAddrs(),
			ConsumerGroup:     group,
			SessionTimeout:    time.Second,
			HeartbeatInterval: 100 * time.Millisecond,
			RebalanceTimeout:  10 * time.Second,
			FetchMaxWait:      50 * time.Millisecond,
			CommitInterval:    100 * time.Millisecond,
			NackResendSleep:   50 * time.Millisecond,
		}, logger)
	case brokerSQS:
		return sqs.New(sqs.BrokerConfig{
			AWSConfig:       sqstest.AWSConfig(),
			OptFns:          sqstest.OptFns(),
			QueueAttributes: map[string]string{"VisibilityTimeout": fmt.Sprint(int(redeliverAfter.Seconds()))},
			WaitTime:        time.Second,
			MaxInFlight:     adapterConcurrency,
			CloseTimeout:    2 * time.Second,
		}, logger)
	case brokerNATS:
		return nats.New(nats.Config{
			URL:              natsURL(),
			ConsumerGroup:    group,
			AckWait:          redeliverAfter,
			MaxAckPending:    4 * adapterConcurrency,
			SubscribersCount: adapterConcurrency,
		}, logger)
	case brokerRedis:
		return redis.New(redis.Config{
			URL:             redisURL(),
			ConsumerGroup:   group,
			NackResendSleep: 50 * time.Millisecond,
			MaxIdleTime:     redeliverAfter,
			ClaimInterval:   200 * time.Millisecond,
		}, logger)
	}
	return nil, fmt.Errorf("broker %q is not built by an adapter package", broker)
}

// startLocalBroker starts the in-process broker of kafka (kfake) and sqs (goaws), which have no
// server on the machine, and returns the environment the consumers need to reach it and a
// function that stops it. Other brokers: nothing.
func startLocalBroker(broker string) (env []string, stop func(), err error) {
	switch broker {
	case brokerKafka:
		addrs, stop, err := kafkafake.Start()
		if err != nil {
			return nil, nil, err
		}
		env := []string{envKafkaBrokers + "=" + strings.Join(addrs, ",")}
		_ = os.Setenv(envKafkaBrokers, strings.Join(addrs, ","))
		return env, stop, nil
	case brokerSQS:
		_, stop, err := sqstest.Start()
		if err != nil {
			return nil, nil, err
		}
		return sqstest.Env(), stop, nil
	}
	return nil, func() {}, nil
}

// adapterAdmin is the orchestrator's access to a broker built by an adapter package: publish
// with its Publisher, read the dead letters with its Subscriber in a group of their own, and
// the broker-specific parts: what is pending, cleanup.
type adapterAdmin struct {
	name   string
	b      *adapters.Broker
	topics topics
	logger watermill.LoggerAdapter
	// pending counts what the broker still holds for the billing consumer group.
	pending        func(ctx context.Context) (int64, error)
	pendingMeaning string
	cleanup        func(ctx context.Context) error
	closers        []func() error
}

func newAdapterAdmin(name string, t topics, logger watermill.LoggerAdapter) (*adapterAdmin, error) {
	b, err := newAdapterBroker(name, consumerName, logger)
	if err != nil {
		return nil, fmt.Errorf("%s broker: %w", name, err)
	}
	a := &adapterAdmin{name: name, b: b, topics: t, logger: logger, cleanup: func(context.Context) error { return nil }}
	if err := a.initBrokerSpecific(); err != nil {
		_ = a.Close()
		return nil, err
	}
	// Create the three topics (streams, queues) before anything is published, so nothing
	// the consumers publish can go nowhere, and the dead-letter topic is there to be read.
	for _, topic := range a.allTopics() {
		if err := a.createTopic(topic); err != nil {
			_ = a.Close()
			return nil, fmt.Errorf("create topic %s: %w", topic, err)
		}
	}
	return a, nil
}

func (a *adapterAdmin) allTopics() []string {
	return []string{a.topics.payments, a.topics.deadLetters, a.topics.receipts}
}

func (a *adapterAdmin) createTopic(topic string) error {
	if a.name == brokerKafka {
		return nil // kfake creates a topic on first use (kafkafake.DefaultPartitions partitions)
	}
	if si, ok := a.b.Subscriber.(message.SubscribeInitializer); ok {
		return si.SubscribeInitialize(topic)
	}
	return nil
}

func (a *adapterAdmin) initBrokerSpecific() error {
	switch a.name {
	case brokerNATS:
		nc, err := natsgo.Connect(natsURL(), natsgo.Name("billing-demo-orchestrator"))
		if err != nil {
			return fmt.Errorf("NATS is not reachable at %s: %w", natsURL(), err)
		}
		a.closers = append(a.closers, func() error { nc.Close(); return nil })
		js, err := nc.JetStream()
		if err != nil {
			return fmt.Errorf("JetStream: %w", err)
		}
		a.pending = func(context.Context) (int64, error) {
			ci, err := js.ConsumerInfo(a.topics.payments, consumerName)
			if errors.Is(err, natsgo.ErrConsumerNotFound) {
				si, serr := js.StreamInfo(a.topics.payments)
				if serr != nil {
					return 0, serr
				}
				return int64(si.State.Msgs), nil
			}
			if err != nil {
				return 0, fmt.Errorf("consumer info: %w", err)
			}
			return int64(ci.NumPending) + int64(ci.NumAckPending), nil
		}
		a.pendingMeaning = "messages of stream " + a.topics.payments + " the durable consumer has not delivered or not seen acked (JetStream NumPending + NumAckPending)"
		a.cleanup = func(context.Context) error {
			var errs []error
			for _, topic := range a.allTopics() {
				if err := js.DeleteStream(topic); err != nil {
					errs = append(errs, fmt.Errorf("delete stream %s: %w", topic, err))
				}
			}
			return errors.Join(errs...)
		}
	case brokerRedis:
		opts, err := goredis.ParseURL(redisURL())
		if err != nil {
			return fmt.Errorf("parse INBOX_REDIS_URL: %w", err)
		}
		rc := goredis.NewClient(opts)
		a.closers = append(a.closers, rc.Close)
		a.pending = func(ctx context.Context) (int64, error) {
			groups, err := rc.XInfoGroups(ctx, a.topics.payments).Result()
			if err != nil {
				return 0, fmt.Errorf("XINFO GROUPS %s: %w", a.topics.payments, err)
			}
			for _, g := range groups {
				if g.Name == consumerName {
					return g.Pending + g.Lag, nil
				}
			}
			return rc.XLen(ctx, a.topics.payments).Result()
		}
		a.pendingMeaning = "entries of stream " + a.topics.payments + " pending or not yet read in consumer group " + consumerName + " (XINFO GROUPS pending + lag)"
		a.cleanup = func(ctx context.Context) error {
			return rc.Del(ctx, a.allTopics()...).Err()
		}
	case brokerKafka:
		a.pending = func(context.Context) (int64, error) { return kafkaLag(kafkaAddrs(), consumerName, a.topics.payments) }
		a.pendingMeaning = "records of topic " + a.topics.payments + " after consumer group " + consumerName + "'s committed offsets"
		// The kfake cluster lives in this process and goes with it.
	case brokerSQS:
		client := sqstest.Client()
		a.pending = func(ctx context.Context) (int64, error) {
			u, err := client.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(a.topics.payments)})
			if err != nil {
				return 0, err
			}
			out, err := client.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{QueueUrl: u.QueueUrl, AttributeNames: []sqstypes.QueueAttributeName{
				sqstypes.QueueAttributeNameApproximateNumberOfMessages, sqstypes.QueueAttributeNameApproximateNumberOfMessagesNotVisible,
			}})
			if err != nil {
				return 0, err
			}
			var n int64
			for _, k := range []sqstypes.QueueAttributeName{sqstypes.QueueAttributeNameApproximateNumberOfMessages, sqstypes.QueueAttributeNameApproximateNumberOfMessagesNotVisible} {
				var v int64
				_, _ = fmt.Sscan(out.Attributes[string(k)], &v)
				n += v
			}
			return n, nil
		}
		a.pendingMeaning = "messages in queue " + a.topics.payments + ", visible or in flight"
		// goaws lives in this process and goes with it.
	}
	return nil
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

func (a *adapterAdmin) Publish(msgs []*message.Message) error {
	return publishInBatches(a.b.Publisher, a.topics.payments, msgs)
}

func (a *adapterAdmin) Pending(ctx context.Context) (int64, error) { return a.pending(ctx) }

func (a *adapterAdmin) PendingMeaning() string { return a.pendingMeaning }

// DeadLetters subscribes to the dead-letter topic in a consumer group of its own (on SQS:
// takes the messages off the queue) and reads until want messages arrived and none more for a
// second, or none at all for deadLetterWait.
func (a *adapterAdmin) DeadLetters(ctx context.Context, want int) ([]deadLetter, error) {
	b, err := newAdapterBroker(a.name, deadLetterReaderGroup, a.logger)
	if err != nil {
		return nil, err
	}
	defer b.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msgs, err := b.Subscriber.Subscribe(ctx, a.topics.deadLetters)
	if err != nil {
		return nil, fmt.Errorf("subscribe to %s: %w", a.topics.deadLetters, err)
	}
	var dls []deadLetter
	const deadLetterWait = 15 * time.Second
	for {
		quiet := deadLetterWait
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

func (a *adapterAdmin) Cleanup(ctx context.Context) error { return a.cleanup(ctx) }

func (a *adapterAdmin) Close() error {
	errs := []error{a.b.Close()}
	for _, c := range a.closers {
		errs = append(errs, c())
	}
	return errors.Join(errs...)
}
