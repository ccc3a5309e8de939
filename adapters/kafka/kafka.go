package kafka

import (
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Name is the adapter's name in router configuration, registered when the package is imported
// (driver.go).
const Name = "kafka"

// Defaults that Config's zero values stand for.
const (
	// DefaultClientID is the Kafka client.id sent to the brokers (it names the client in broker
	// logs and quotas).
	DefaultClientID = "watermill-inbox"
	// DefaultInitialOffset is where a consumer group starts on a partition for which it has no
	// committed offset: the oldest retained record. Sarama's own default, sarama.OffsetNewest,
	// makes a newly created group skip every record published before it first joined.
	DefaultInitialOffset = sarama.OffsetOldest
	// DefaultCommitInterval is how often sarama commits the offsets of acked records (sarama's
	// Consumer.Offsets.AutoCommit.Interval default).
	DefaultCommitInterval = time.Second
	// DefaultSessionTimeout is sarama's Consumer.Group.Session.Timeout default: a consumer that
	// sends no heartbeat for this long is removed from the group and its partitions reassigned.
	// The brokers bound it (group.min.session.timeout.ms, 6 s by default in Kafka, and
	// group.max.session.timeout.ms).
	DefaultSessionTimeout = 10 * time.Second
	// DefaultHeartbeatInterval is sarama's Consumer.Group.Heartbeat.Interval default.
	DefaultHeartbeatInterval = 3 * time.Second
	// DefaultRebalanceTimeout is sarama's Consumer.Group.Rebalance.Timeout default: how long the
	// coordinator waits for every member to rejoin during a rebalance. A member rejoins only
	// after its in-flight messages were acked or nacked, so keep it above the slowest handler.
	DefaultRebalanceTimeout = 60 * time.Second
	// DefaultFetchMaxWait is sarama's Consumer.MaxWaitTime default: how long a broker holds a
	// fetch request open when it has no new records.
	DefaultFetchMaxWait = 500 * time.Millisecond
	// DefaultNackResendSleep is watermill-kafka's pause before a nacked record is sent to the
	// router again.
	DefaultNackResendSleep = 100 * time.Millisecond
	// DefaultReconnectRetrySleep is watermill-kafka's pause between attempts to re-create a
	// consumer that stopped.
	DefaultReconnectRetrySleep = time.Second
	// DefaultProducerRetries is how many times the producer retries a failed send (sarama
	// Producer.Retry.Max; watermill-kafka's publisher default).
	DefaultProducerRetries = 10
)

// CommitEveryAck, as Config.CommitInterval, turns sarama's auto-commit off; watermill-kafka
// then commits synchronously after every ack (one OffsetCommit round trip per message), so a
// crash never causes more than the one unacked record per partition to be delivered again.
const CommitEveryAck time.Duration = -1

// MinSaramaVersion is the oldest Kafka protocol version Config accepts: 0.11.0, where Kafka
// introduced record headers (KIP-82). The producer's message ID travels in a header; older
// versions drop it and every message would arrive without an ID.
var MinSaramaVersion = sarama.V0_11_0_0

// Config configures the Publisher and the Subscriber. Zero values take the defaults documented
// on each field. The same Config may serve both: the publisher ignores the consumer fields.
type Config struct {
	// Brokers lists bootstrap brokers as "host:port" (required, no empty entries).
	Brokers []string
	// ConsumerGroup is the Kafka consumer group of the subscriber (required by NewSubscriber).
	// Every subscriber of the group shares the partitions of a topic, and the group's committed
	// offsets say where it resumes. Without a group, watermill-kafka would read every partition
	// from InitialOffset on each start and commit nothing.
	ConsumerGroup string
	// InitialOffset is where the group starts on a partition without a committed offset:
	// sarama.OffsetOldest or sarama.OffsetNewest. Default: DefaultInitialOffset (oldest). It
	// also applies when a committed offset is out of range (retention deleted the records) or
	// the group's offsets expired (broker offsets.retention.minutes): with OffsetNewest the
	// records in between are skipped, with OffsetOldest they are delivered again and the inbox
	// skips those it still remembers.
	InitialOffset int64
	// SaramaVersion is the Kafka protocol version sarama speaks; it must not be newer than the
	// brokers. Default: sarama.DefaultVersion (2.8.0 in sarama v1.61.1). At least
	// MinSaramaVersion.
	SaramaVersion sarama.KafkaVersion
	// ClientID is the Kafka client.id. Default: DefaultClientID.
	ClientID string
	// Marshaler converts between Watermill messages and Kafka records. Default:
	// watermill-kafka's DefaultMarshaler, plus a record key from PartitionKey when that is
	// set. A custom one must carry msg.UUID across (in the `_watermill_message_uuid` header,
	// wmkafka.UUIDHeaderKey): it is the inbox key. Set Marshaler or PartitionKey, not both.
	Marshaler wmkafka.MarshalerUnmarshaler
	// PartitionKey, when set, returns the Kafka record key of each published message; sarama's
	// hash partitioner sends equal keys to the same partition, which keeps their order
	// (e.g. an account ID, so the payments of one account are applied in order). An empty key
	// means no key, as without PartitionKey. (watermill-kafka's own
	// NewWithPartitioningMarshaler sends "" as a real, empty key: every such message lands on
	// the one partition that key hashes to.) Default: nil, records without a key, spread over
	// partitions at random.
	PartitionKey wmkafka.GeneratePartitionKey
	// CommitInterval is how often sarama commits the offsets of acked records, or
	// CommitEveryAck to commit synchronously after every ack. Default: DefaultCommitInterval.
	// Either way only acked records are committed; a longer interval means more (harmless,
	// inbox-skipped) redeliveries after a crash.
	CommitInterval time.Duration
	// SessionTimeout: see DefaultSessionTimeout. Default: DefaultSessionTimeout. Milliseconds
	// are the protocol's precision.
	SessionTimeout time.Duration
	// HeartbeatInterval is how often the consumer heartbeats the group coordinator; a rebalance
	// is noticed at the next heartbeat. Default: DefaultHeartbeatInterval, or a third of
	// SessionTimeout when that is shorter (Kafka's recommendation). Must be below
	// SessionTimeout.
	HeartbeatInterval time.Duration
	// RebalanceTimeout: see DefaultRebalanceTimeout. Default: DefaultRebalanceTimeout.
	RebalanceTimeout time.Duration
	// FetchMaxWait is how long a broker may hold a fetch open waiting for new records
	// (sarama Consumer.MaxWaitTime). Default: DefaultFetchMaxWait. Sarama sends heartbeats
	// and offset commits on the same connection as the fetches to the coordinator broker, and
	// Kafka answers one request per connection at a time, so an idle partition delays both by
	// up to this long: keep it well below HeartbeatInterval when SessionTimeout is short.
	FetchMaxWait time.Duration
	// NackResendSleep is the pause before a nacked record is re-sent to the router (the
	// partition waits meanwhile). Default: DefaultNackResendSleep. wmkafka.NoSleep for none.
	NackResendSleep time.Duration
	// ReconnectRetrySleep is the pause between attempts to restart a stopped consumer.
	// Default: DefaultReconnectRetrySleep. wmkafka.NoSleep for none.
	ReconnectRetrySleep time.Duration
}

func (c *Config) setDefaults() {
	if c.InitialOffset == 0 {
		c.InitialOffset = DefaultInitialOffset
	}
	if c.SaramaVersion == (sarama.KafkaVersion{}) {
		c.SaramaVersion = sarama.DefaultVersion
	}
	if c.ClientID == "" {
		c.ClientID = DefaultClientID
	}
	if c.Marshaler == nil {
		if c.PartitionKey != nil {
			c.Marshaler = partitioningMarshaler{key: c.PartitionKey}
		} else {
			c.Marshaler = wmkafka.DefaultMarshaler{}
		}
	}
	if c.CommitInterval == 0 {
		c.CommitInterval = DefaultCommitInterval
	}
	if c.SessionTimeout == 0 {
		c.SessionTimeout = DefaultSessionTimeout
	}
	if c.HeartbeatInterval == 0 {
		c.HeartbeatInterval = min(DefaultHeartbeatInterval, c.SessionTimeout/3)
	}
	if c.RebalanceTimeout == 0 {
		c.RebalanceTimeout = DefaultRebalanceTimeout
	}
	if c.FetchMaxWait == 0 {
		c.FetchMaxWait = DefaultFetchMaxWait
	}
	if c.NackResendSleep == 0 {
		c.NackResendSleep = DefaultNackResendSleep
	}
	if c.ReconnectRetrySleep == 0 {
		c.ReconnectRetrySleep = DefaultReconnectRetrySleep
	}
}

// Validate returns an error wrapping inbox.ErrInvalidConfig for: no brokers or an empty
// broker address; an InitialOffset other than sarama.OffsetOldest / sarama.OffsetNewest; a
// SaramaVersion older than MinSaramaVersion; both Marshaler and PartitionKey set; a negative
// duration (other than CommitEveryAck and wmkafka.NoSleep where documented); a
// HeartbeatInterval not below SessionTimeout. It checks a Config as given (zero values are
// valid: they stand for defaults) and does not require ConsumerGroup; NewSubscriber does.
func (c Config) Validate() error {
	if len(c.Brokers) == 0 {
		return invalid("Brokers is required")
	}
	for i, b := range c.Brokers {
		if strings.TrimSpace(b) == "" {
			return invalid(fmt.Sprintf("Brokers[%d] is empty", i))
		}
	}
	switch c.InitialOffset {
	case 0, sarama.OffsetOldest, sarama.OffsetNewest:
	default:
		return invalid(fmt.Sprintf("InitialOffset %d: use sarama.OffsetOldest (%d) or sarama.OffsetNewest (%d)",
			c.InitialOffset, sarama.OffsetOldest, sarama.OffsetNewest))
	}
	if c.SaramaVersion != (sarama.KafkaVersion{}) && !c.SaramaVersion.IsAtLeast(MinSaramaVersion) {
		return invalid(fmt.Sprintf("SaramaVersion %s is older than %s, the first with record headers (KIP-82), which carry the message ID",
			c.SaramaVersion, MinSaramaVersion))
	}
	if c.Marshaler != nil && c.PartitionKey != nil {
		return invalid("set Marshaler or PartitionKey, not both (PartitionKey adds a record key to the DefaultMarshaler)")
	}
	if c.CommitInterval < 0 && c.CommitInterval != CommitEveryAck {
		return invalid("CommitInterval must be positive, zero (default) or CommitEveryAck")
	}
	if c.SessionTimeout < 0 || c.HeartbeatInterval < 0 || c.RebalanceTimeout < 0 || c.FetchMaxWait < 0 {
		return invalid("SessionTimeout, HeartbeatInterval, RebalanceTimeout and FetchMaxWait must not be negative")
	}
	if (c.NackResendSleep < 0 && c.NackResendSleep != wmkafka.NoSleep) ||
		(c.ReconnectRetrySleep < 0 && c.ReconnectRetrySleep != wmkafka.NoSleep) {
		return invalid("NackResendSleep and ReconnectRetrySleep must be positive, zero (default) or wmkafka.NoSleep")
	}
	d := c
	d.setDefaults()
	if session, heartbeat := d.SessionTimeout, d.HeartbeatInterval; heartbeat >= session {
		return invalid(fmt.Sprintf("HeartbeatInterval (%s) must be below SessionTimeout (%s)", heartbeat, session))
	}
	return nil
}

func invalid(why string) error {
	return fmt.Errorf("%w: kafka: %s", inbox.ErrInvalidConfig, why)
}

// errNoGroup is returned by SubscriberConfig and NewSubscriber when ConsumerGroup is empty.
var errNoGroup = invalid("ConsumerGroup is required: without a group watermill-kafka reads every partition from InitialOffset on each start and commits no offsets")

// SubscriberConfig returns the watermill-kafka subscriber configuration NewSubscriber uses
// (defaults applied, validated), for callers that need a sarama setting Config does not
// expose. Changing it can break at-least-once: keep Consumer.Offsets.AutoCommit as set (only
// watermill-kafka's marks, made after the ack, may be committed) and never mark or commit
// offsets elsewhere. Its Unmarshaler (Config.Marshaler, wrapped) and Tracer (a wrapper of
// the consumer-group handler, no tracing) give the first-delivery signal that Redelivery
// reads; replace either and Redelivery returns inbox.RedeliveryUnknown for that subscriber's
// messages. Change OverwriteSaramaConfig in place rather than replacing it: the signal reads
// it (static membership, Consumer.Group.InstanceId, turns the signal off). Errors wrap
// inbox.ErrInvalidConfig.
func (c Config) SubscriberConfig() (wmkafka.SubscriberConfig, error) {
	if err := c.Validate(); err != nil {
		return wmkafka.SubscriberConfig{}, err
	}
	if strings.TrimSpace(c.ConsumerGroup) == "" {
		return wmkafka.SubscriberConfig{}, errNoGroup
	}
	c.setDefaults()
	sc := c.baseSarama()
	sc.Consumer.Return.Errors = true // watermill-kafka drains and logs them
	sc.Consumer.Offsets.Initial = c.InitialOffset
	if c.CommitInterval == CommitEveryAck {
		sc.Consumer.Offsets.AutoCommit.Enable = false
	} else {
		sc.Consumer.Offsets.AutoCommit.Enable = true
		sc.Consumer.Offsets.AutoCommit.Interval = c.CommitInterval
	}
	sc.Consumer.Group.Session.Timeout = c.SessionTimeout
	sc.Consumer.Group.Heartbeat.Interval = c.HeartbeatInterval
	sc.Consumer.Group.Rebalance.Timeout = c.RebalanceTimeout
	sc.Consumer.MaxWaitTime = c.FetchMaxWait
	if err := sc.Validate(); err != nil {
		return wmkafka.SubscriberConfig{}, invalid("sarama: " + err.Error())
	}
	brokers := append([]string(nil), c.Brokers...)
	return wmkafka.SubscriberConfig{
		Brokers:               brokers,
		Unmarshaler:           signalUnmarshaler{inner: c.Marshaler},
		OverwriteSaramaConfig: sc,
		ConsumerGroup:         c.ConsumerGroup,
		NackResendSleep:       c.NackResendSleep,
		ReconnectRetrySleep:   c.ReconnectRetrySleep,
		Tracer: &signalTracer{
			brokers: brokers, group: c.ConsumerGroup, sarama: sc, logger: watermill.NopLogger{},
		},
	}, nil
}

// PublisherConfig returns the watermill-kafka publisher configuration NewPublisher uses
// (defaults applied, validated). The producer waits for every in-sync replica
// (sarama.WaitForAll) before Publish returns, and retries a failed send DefaultProducerRetries
// times; a retry that Kafka had in fact stored gives a second record with the same message
// UUID, which the inbox skips. Errors wrap inbox.ErrInvalidConfig.
func (c Config) PublisherConfig() (wmkafka.PublisherConfig, error) {
	if err := c.Validate(); err != nil {
		return wmkafka.PublisherConfig{}, err
	}
	c.setDefaults()
	sc := c.baseSarama()
	sc.Producer.Return.Successes = true // required by sarama's SyncProducer
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Retry.Max = DefaultProducerRetries
	if err := sc.Validate(); err != nil {
		return wmkafka.PublisherConfig{}, invalid("sarama: " + err.Error())
	}
	return wmkafka.PublisherConfig{
		Brokers:               append([]string(nil), c.Brokers...),
		Marshaler:             c.Marshaler,
		OverwriteSaramaConfig: sc,
	}, nil
}

func (c Config) baseSarama() *sarama.Config {
	sc := sarama.NewConfig()
	sc.Version = c.SaramaVersion
	sc.ClientID = c.ClientID
	return sc
}

// NewSubscriber returns a watermill-kafka consumer-group subscriber (a *wmkafka.Subscriber)
// configured by SubscriberConfig. It connects lazily, on Subscribe. Errors wrap
// inbox.ErrInvalidConfig for an invalid Config or a missing ConsumerGroup. A nil logger
// discards logs.
func NewSubscriber(cfg Config, logger watermill.LoggerAdapter) (message.Subscriber, error) {
	sc, err := cfg.SubscriberConfig()
	if err != nil {
		return nil, err
	}
	logger = redact.Logger(logger, cfg.Brokers...)
	if t, ok := sc.Tracer.(*signalTracer); ok && logger != nil {
		t.logger = logger
	}
	sub, err := wmkafka.NewSubscriber(sc, logger)
	if err != nil {
		return nil, fmt.Errorf("kafka: subscriber: %w", redact.Err(err, cfg.Brokers...))
	}
	return sub, nil
}

// NewPublisher returns a watermill-kafka synchronous publisher (a *wmkafka.Publisher)
// configured by PublisherConfig: Publish returns once Kafka stored each message. It connects
// to the brokers at once and returns their error if none answers. Configuration errors wrap
// inbox.ErrInvalidConfig. A nil logger discards logs.
func NewPublisher(cfg Config, logger watermill.LoggerAdapter) (message.Publisher, error) {
	pc, err := cfg.PublisherConfig()
	if err != nil {
		return nil, err
	}
	pub, err := wmkafka.NewPublisher(pc, redact.Logger(logger, cfg.Brokers...))
	if err != nil {
		return nil, fmt.Errorf("kafka: publisher: %w", redact.Err(err, cfg.Brokers...))
	}
	return pub, nil
}

// New returns the broker: NewPublisher's publisher, NewSubscriber's consumer-group subscriber
// (cfg.ConsumerGroup is required) and BrokerSideFields. The publisher connects at once; the
// subscriber on Subscribe. Errors wrap inbox.ErrInvalidConfig for an invalid Config. A nil
// logger discards logs.
//
// NewSubscriber builds a subscriber of another consumer group on the same Config: each group
// has its own committed offsets and reads every record of a topic; a group without committed
// offsets starts at InitialOffset (the oldest retained record by default), so records
// published before it first subscribed are read unless retention deleted them. The Broker's
// Redelivery is this package's Redelivery: FirstDelivery for a record appended after the
// consuming session was assigned its partition, RedeliveryUnknown otherwise.
//
// Topics are not created by the adapter: the brokers must create them on first use
// (auto.create.topics.enable, Kafka's default, with num.partitions partitions) or an operator
// must create them beforehand, the dead-letter topic included. A Publish to a missing topic
// fails (the inbox then retries the delivery); a Subscribe to one retries every
// ReconnectRetrySleep until it exists.
func New(cfg Config, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	sub, err := NewSubscriber(cfg, logger)
	if err != nil {
		return nil, err
	}
	pub, err := NewPublisher(cfg, logger)
	if err != nil {
		_ = sub.Close()
		return nil, err
	}
	newSub := func(group string) (message.Subscriber, error) {
		if group == "" {
			return nil, invalid("empty consumer group")
		}
		gc := cfg
		gc.ConsumerGroup = group
		return NewSubscriber(gc, logger)
	}
	return &adapters.Broker{
		Name: Name, Publisher: pub, Subscriber: sub, NewSubscriber: newSub,
		BrokerSideFields: BrokerSideFields, Redelivery: Redelivery,
	}, nil
}

// ParseBrokers reads a broker list as configuration gives it: addresses "host:port" separated
// by commas, optionally behind a kafka:// scheme (kafka://k1:9092,k2:9092); spaces around
// entries and a trailing slash are ignored. It returns an error wrapping inbox.ErrInvalidConfig
// for another scheme, an empty list or entry, or an entry that is not host:port.
//
// A list is printed in errors with every entry's password masked (internal/redact.URL).
func ParseBrokers(s string) ([]string, error) {
	raw := s
	s = redactBrokers(s)
	rest := strings.TrimSpace(raw)
	if scheme, after, ok := strings.Cut(rest, "://"); ok {
		if !strings.EqualFold(scheme, "kafka") {
			return nil, invalid(fmt.Sprintf("broker list %q: scheme %q, want kafka:// or none", s, scheme))
		}
		rest = after
	}
	rest = strings.TrimSuffix(rest, "/")
	if strings.TrimSpace(rest) == "" {
		return nil, invalid("empty broker list")
	}
	var out []string
	for i, b := range strings.Split(rest, ",") {
		b = strings.TrimSpace(b)
		if b == "" {
			return nil, invalid(fmt.Sprintf("broker list %q: entry %d is empty", s, i))
		}
		if _, port, err := net.SplitHostPort(b); err != nil || port == "" {
			return nil, invalid(fmt.Sprintf("broker list %q: entry %q is not host:port", s, redact.URL(b)))
		}
		out = append(out, b)
	}
	return out, nil
}

// redactBrokers is a broker list for errors: each entry with its password masked.
func redactBrokers(list string) string {
	parts := strings.Split(list, ",")
	for i, p := range parts {
		parts[i] = redact.URL(p)
	}
	return strings.Join(parts, ",")
}

// BrokerSideFields names the values watermill-kafka v3 exposes about a consumed record that
// describe its storage or delivery rather than the message, each with the reason it is not a
// message ID. watermill-kafka puts them in the message context, not in metadata (read them
// with wmkafka.MessagePartitionFromCtx, MessagePartitionOffsetFromCtx, MessageTimestampFromCtx
// and MessageKeyFromCtx); the names here are those of the context accessors and of
// watermill-kafka's log fields, which are the names a metadata field copying them would
// likely get. Keys are lower case. Never use one as the inbox key: pass the map to
// inbox.MetadataKey (inbox.MetadataKey(field, kafka.BrokerSideFields)), which refuses them
// case-insensitively, and to inbox.Config.BrokerSideFields. New returns it as the Broker's
// BrokerSideFields.
var BrokerSideFields = brokerside.Kafka

// partitioningMarshaler is watermill-kafka's DefaultMarshaler plus a record key from key; an
// empty key leaves the record without one (sarama then picks a random partition).
type partitioningMarshaler struct {
	wmkafka.DefaultMarshaler
	key wmkafka.GeneratePartitionKey
}

func (m partitioningMarshaler) Marshal(topic string, msg *message.Message) (*sarama.ProducerMessage, error) {
	rec, err := m.DefaultMarshaler.Marshal(topic, msg)
	if err != nil {
		return nil, err
	}
	key, err := m.key(topic, msg)
	if err != nil {
		return nil, fmt.Errorf("kafka: partition key of message %s: %w", msg.UUID, err)
	}
	if key != "" {
		rec.Key = sarama.StringEncoder(key)
	}
	return rec, nil
}
