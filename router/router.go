// Package router builds a Watermill router for inbox-wrapped handlers from configuration: the
// broker is a configuration value (INBOX_BROKER, or a JSON file), so a handler moves between
// PostgreSQL, RabbitMQ, Kafka, SQS, NATS JetStream and Redis Streams without a code change.
//
//	cfg, err := router.ConfigFromEnv()        // INBOX_BROKER=amqp INBOX_BROKER_URL=amqp://...
//	r, err := router.New(cfg, pool, logger)
//	shipping, err := r.NewInbox(inbox.Config{Store: store, ConsumerName: "shipping"}, logger)
//	analytics, err := r.NewInbox(inbox.Config{Store: store, ConsumerName: "analytics"}, logger)
//	_, err = r.AddConsumer(shipping, "orders", ship)    // each consumer name gets every message
//	_, err = r.AddConsumer(analytics, "orders", count)
//	err = r.Run(ctx)
//
// Each consumer name is a consumer group of its own on the broker (ConsumerGroupPrefix +
// consumer name): every consumer name receives every message of a topic, and the instances of
// one consumer name (several routers, several processes) share its messages.
package router

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka"
	"github.com/watermill-inbox/watermill-inbox/adapters/nats"
	"github.com/watermill-inbox/watermill-inbox/adapters/postgres"
	"github.com/watermill-inbox/watermill-inbox/adapters/redis"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/internal/defaults"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Brokers lists the broker names New accepts.
var Brokers = []string{postgres.Name, amqp.Name, kafka.Name, sqs.Name, nats.Name, redis.Name}

// Config selects and addresses the broker.
type Config struct {
	// Broker is the adapter's name: "postgres" (default), "amqp", "kafka", "sqs", "nats" or
	// "redis".
	Broker string `json:"broker"`
	// URL is the broker's address. For "postgres" it is unused: the pool passed to New is
	// the broker. For "amqp" it is the AMQP URI. For "kafka" it is the bootstrap brokers,
	// comma-separated host:port, optionally behind kafka:// (kafka://k1:9092,k2:9092). For
	// "sqs" it is optional: an endpoint that replaces the one AWS resolves from the region
	// (e.g. a local SQS-compatible endpoint); region and credentials come from the AWS SDK's
	// default resolution (AWS_REGION, AWS_ACCESS_KEY_ID, AWS_PROFILE, instance roles...). For
	// "nats" it is the NATS URL (nats://127.0.0.1:4222), for "redis" the Redis URL
	// (redis://127.0.0.1:6379/0).
	URL string `json:"url"`
	// ConsumerGroupPrefix is prepended to each consumer name to name its consumer group
	// (amqp: the queue "<topic>_<group>"; postgres: the offset row; kafka: the consumer group;
	// nats: the durable consumer and deliver group; redis: the stream consumer group). Set it
	// when several applications with their own inbox databases share one broker and might
	// reuse a consumer name. The group must be a valid name for the broker (nats: no '.', '*',
	// '>', '/', '\' or whitespace). Default: "" (the group is the consumer name).
	// Broker.Subscriber, for tools, consumes in group ConsumerGroupPrefix+DefaultConsumerGroup.
	ConsumerGroupPrefix string `json:"consumer_group_prefix"`
	// SQSQueryProtocol makes the "sqs" broker speak the AWS query protocol instead of the
	// SDK's default JSON protocol. Amazon SQS speaks both: leave it off against AWS. Set it
	// for an SQS-compatible endpoint that speaks only the query protocol, such as goaws.
	SQSQueryProtocol bool `json:"sqs_query_protocol"`
	// Mode is the inbox mode of AddModeConsumer: "immediate" (default: the handler runs in
	// the delivery, see package middleware/inbox) or "store-then-process" (the delivery is
	// stored and acked, workers run the handler later, see package middleware/deferred).
	// Environment: INBOX_MODE.
	Mode string `json:"mode"`

	// Postgres, AMQP, Kafka, SQS, NATS and Redis, when set, hold the settings of that
	// broker's adapter beyond the address and the consumer group (timings, concurrency,
	// queue arguments): NewBroker copies the one of the configured broker, fills in what the
	// fields above decide (Pool, URL, Brokers, ConsumerGroup, the SQS endpoint and protocol)
	// and passes it to the adapter's New. Nil: the adapter's defaults. They are set in code,
	// never read from JSON or the environment.
	Postgres *postgres.Config `json:"-"`
	// AMQP: see Postgres.
	AMQP *amqp.Config `json:"-"`
	// Kafka: see Postgres.
	Kafka *kafka.Config `json:"-"`
	// SQS: see Postgres. When its AWSConfig has a Region, that AWS configuration replaces the
	// SDK's default resolution; its OptFns run before the endpoint and protocol of URL and
	// SQSQueryProtocol.
	SQS *sqs.BrokerConfig `json:"-"`
	// NATS: see Postgres.
	NATS *nats.Config `json:"-"`
	// Redis: see Postgres.
	Redis  *redis.Config `json:"-"`
	source int           // sourceCode, sourceEnv or sourceJSON
	path   string        // the JSON file, for sourceJSON

	// Batch turns on group commit (inbox.BatchConfig) for every inbox NewInbox builds whose
	// own Config.Batch is left zero: deliveries the broker hands out at once share one
	// transaction. A batch is only as big as the broker's concurrency (docs/design.md,
	// "Batched mode"). Set in code, or with INBOX_BATCH_SIZE and INBOX_BATCH_LINGER (a Go
	// duration such as 2ms) through ConfigFromEnv. Default: off.
	Batch inbox.BatchConfig `json:"-"`
}

// DefaultConsumerGroup names, after ConsumerGroupPrefix, the consumer group of
// Router.Broker.Subscriber (the broker's default subscriber, for tools such as a dead-letter
// reader). Consumers added with AddConsumer and AddHandler use their consumer name instead.
const DefaultConsumerGroup = "watermill-inbox"

// Local defaults of Config.URL, used when no URL is configured.
const (
	DefaultAMQPURL  = defaults.AMQPURL
	DefaultNATSURL  = defaults.NATSURL
	DefaultRedisURL = defaults.RedisURL
)

// Where a Config came from, so that its errors name the setting the user wrote.
const (
	sourceCode = iota
	sourceEnv
	sourceJSON
)

// ConfigFromEnv reads INBOX_BROKER, INBOX_BROKER_URL, INBOX_CONSUMER_GROUP_PREFIX and
// INBOX_SQS_QUERY_PROTOCOL. When INBOX_BROKER_URL is unset, INBOX_AMQP_URL, INBOX_NATS_URL or
// INBOX_REDIS_URL is the URL of "amqp", "nats" or "redis", and without those DefaultAMQPURL,
// DefaultNATSURL or DefaultRedisURL. Errors wrap inbox.ErrInvalidConfig and name the
// environment variable. INBOX_CONSUMER_GROUP, the router-wide consumer group of earlier
// versions, is refused: every consumer name is now a consumer group of its own. So is an
// environment that could be read two ways: one of these variables set twice, a variable whose
// name differs from one of them only in case (inbox_broker), or an unknown variable in the
// router's name spaces (INBOX_BROKER*, INBOX_BATCH_*, INBOX_CONSUMER_GROUP*, INBOX_MODE*,
// INBOX_SQS_QUERY*).
func ConfigFromEnv() (Config, error) {
	if err := checkEnv(os.Environ()); err != nil {
		return Config{}, err
	}
	if v := os.Getenv("INBOX_CONSUMER_GROUP"); v != "" {
		return Config{}, fmt.Errorf("%w: router: INBOX_CONSUMER_GROUP=%q is no longer read: each consumer name is its own consumer group; use INBOX_CONSUMER_GROUP_PREFIX to namespace them", inbox.ErrInvalidConfig, v)
	}
	cfg := Config{
		Broker:              os.Getenv("INBOX_BROKER"),
		URL:                 os.Getenv("INBOX_BROKER_URL"),
		ConsumerGroupPrefix: os.Getenv("INBOX_CONSUMER_GROUP_PREFIX"),
		Mode:                os.Getenv("INBOX_MODE"),
		source:              sourceEnv,
	}
	if cfg.URL == "" {
		switch strings.ToLower(strings.TrimSpace(cfg.Broker)) {
		case amqp.Name:
			cfg.URL = os.Getenv("INBOX_AMQP_URL")
		case nats.Name:
			cfg.URL = os.Getenv("INBOX_NATS_URL")
		case redis.Name:
			cfg.URL = os.Getenv("INBOX_REDIS_URL")
		}
	}
	if err := sqsFromEnv(&cfg); err != nil {
		return cfg, err
	}
	if err := batchFromEnv(&cfg); err != nil {
		return cfg, err
	}
	cfg.setDefaults()
	return cfg, cfg.Validate()
}

// LoadConfig reads a JSON file with the fields of Config, e.g.
// {"broker": "amqp", "url": "amqp://guest:guest@127.0.0.1:5672/"}. A missing "url" of amqp,
// nats or redis is the local default (DefaultAMQPURL...). Errors wrap inbox.ErrInvalidConfig
// and name the JSON field and the file. A file that could be read two ways is refused: a field
// given twice, a field whose name differs from one of Config's only in case, an unknown field,
// anything after the object.
func LoadConfig(path string) (Config, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("router: %w", err)
	}
	var cfg Config
	if err := decodeStrictJSON(raw, &cfg); err != nil {
		hint := ""
		if strings.Contains(err.Error(), `"consumer_group"`) {
			hint = ` ("consumer_group" was replaced by "consumer_group_prefix": each consumer name is its own consumer group)`
		}
		return Config{}, fmt.Errorf("%w: router: %s: %v%s", inbox.ErrInvalidConfig, path, err, hint)
	}
	cfg.source, cfg.path = sourceJSON, path
	cfg.setDefaults()
	return cfg, cfg.Validate()
}

func (c *Config) setDefaults() {
	c.Broker = strings.ToLower(strings.TrimSpace(c.Broker))
	if c.Broker == "" {
		c.Broker = postgres.Name
	}
	c.setModeDefault()
	if c.URL == "" {
		switch c.Broker {
		case amqp.Name:
			c.URL = DefaultAMQPURL
		case nats.Name:
			c.URL = DefaultNATSURL
		case redis.Name:
			c.URL = DefaultRedisURL
		}
	}
}

// setting names a configuration field as the user wrote it: the environment variable, the
// JSON field and file, or the Go field.
func (c Config) setting(env, jsonField, goField string) string {
	switch c.source {
	case sourceEnv:
		return env
	case sourceJSON:
		return fmt.Sprintf("%q in %s", jsonField, c.path)
	}
	return "Config." + goField
}

// Validate returns an error wrapping inbox.ErrInvalidConfig for an unknown broker or an
// invalid URL (for kafka, a missing one: it has no local default). The error names the
// setting as it was given: the environment variable (ConfigFromEnv), the JSON field and file
// (LoadConfig), or the Config field.
func (c Config) Validate() error {
	if err := c.validateMode(); err != nil {
		return err
	}
	switch c.Broker {
	case postgres.Name, amqp.Name, nats.Name, redis.Name:
	case kafka.Name:
		if _, err := kafka.ParseBrokers(c.URL); err != nil {
			return fmt.Errorf("router: broker %q needs its bootstrap brokers in %s: %w", c.Broker, c.setting("INBOX_BROKER_URL", "url", "URL"), err)
		}
	case sqs.Name:
		return validateSQS(c)
	default:
		return fmt.Errorf("%w: router: unknown broker %q in %s (one of %s)", inbox.ErrInvalidConfig, c.Broker, c.setting("INBOX_BROKER", "broker", "Broker"), strings.Join(Brokers, ", "))
	}
	return nil
}

// NewBroker builds the configured broker. pool is the database the inbox uses; the postgres
// broker uses it too. Its Subscriber consumes in consumer group
// cfg.ConsumerGroupPrefix+DefaultConsumerGroup (for amqp and sqs: the queue named after the
// topic).
func NewBroker(cfg Config, pool *pgxpool.Pool, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	group := cfg.ConsumerGroupPrefix + DefaultConsumerGroup
	switch cfg.Broker {
	case amqp.Name:
		c := base(cfg.AMQP)
		c.URL = cfg.URL
		return amqp.New(c, logger)
	case kafka.Name:
		brokers, err := kafka.ParseBrokers(cfg.URL)
		if err != nil {
			return nil, err
		}
		c := base(cfg.Kafka)
		c.Brokers, c.ConsumerGroup = brokers, group
		return kafka.New(c, logger)
	case sqs.Name:
		return newSQSBroker(cfg, logger)
	case nats.Name:
		c := base(cfg.NATS)
		c.URL, c.ConsumerGroup = cfg.URL, group
		return nats.New(c, logger)
	case redis.Name:
		c := base(cfg.Redis)
		c.URL, c.ConsumerGroup = cfg.URL, group
		return redis.New(c, logger)
	default:
		c := base(cfg.Postgres)
		c.Pool, c.ConsumerGroup = pool, group
		return postgres.New(c, logger)
	}
}

// base returns a copy of *c, or the zero value for nil.
func base[T any](c *T) T {
	var v T
	if c != nil {
		v = *c
	}
	return v
}

// Router is a Watermill router on one broker, with the recommended router-level middleware.
type Router struct {
	*message.Router
	// Broker is the configured broker; its Publisher is the one produced messages and dead
	// letters should use.
	Broker *adapters.Broker

	prefix string
	batch  inbox.BatchConfig   // Config.Batch
	mode   string              // Config.Mode
	ws     []*deferred.Workers // store-then-process workers, run with the router
	wsRun  bool                // the workers were started
	mu     sync.Mutex
	subs   map[string]message.Subscriber // consumer group -> its subscriber
	names  map[string]int                // consumer name -> handlers added for it
	topics map[string]string             // topic -> consumer name, on a broker without fan-out
}

// New builds the broker and a router whose router-level middleware is, outermost first,
// CorrelationID and Recoverer. Close closes the router, then the consumers' subscribers, then
// the broker.
func New(cfg Config, pool *pgxpool.Pool, logger watermill.LoggerAdapter) (*Router, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	b, err := NewBroker(cfg, pool, logger)
	if err != nil {
		return nil, err
	}
	// Watermill's router logs message UUIDs and handler errors: quoted when they hold control
	// characters, so a producer cannot forge log lines (internal/redact.Escape).
	r, err := message.NewRouter(message.RouterConfig{}, redact.Escape(logger))
	if err != nil {
		_ = b.Close()
		return nil, err
	}
	r.AddMiddleware(wmmiddleware.CorrelationID, wmmiddleware.Recoverer)
	return &Router{
		Router: r, Broker: b, prefix: cfg.ConsumerGroupPrefix, batch: cfg.Batch, mode: cfg.Mode,
		subs: map[string]message.Subscriber{}, names: map[string]int{}, topics: map[string]string{},
	}, nil
}

// subscriberFor returns the subscriber of consumer name's consumer group (ConsumerGroupPrefix +
// name), made on first use, and the handler name to register: the consumer name, then
// "<name>-2", "<name>-3"... for further handlers of the same consumer name, which compete for
// its messages. On a broker without fan-out (sqs) it returns the broker's Subscriber and refuses
// a second consumer name on one topic with an error wrapping adapters.ErrNoFanOut: the two
// would compete for the topic's queue and each see only part of its messages.
//
// On amqp it declares the group's queue and binds it to the topic at once (SubscribeInitialize),
// so messages published between AddConsumer and Run are kept for the group.
func (r *Router) subscriberFor(name, topic string) (message.Subscriber, string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var sub message.Subscriber
	if r.Broker.NewSubscriber == nil {
		if other, ok := r.topics[topic]; ok && other != name {
			return nil, "", fmt.Errorf("router: consumers %q and %q of topic %q on broker %q: %w (give a topic one consumer name there)", other, name, topic, r.Broker.Name, adapters.ErrNoFanOut)
		}
		r.topics[topic] = name
		sub = r.Broker.Subscriber
	} else {
		group := r.prefix + name
		sub = r.subs[group]
		if sub == nil {
			var err error
			if sub, err = r.Broker.SubscriberFor(group); err != nil {
				return nil, "", fmt.Errorf("router: consumer %q: %w", name, err)
			}
			r.subs[group] = sub
		}
	}
	if r.Broker.Name == amqp.Name {
		if si, ok := sub.(message.SubscribeInitializer); ok {
			if err := si.SubscribeInitialize(topic); err != nil {
				return nil, "", fmt.Errorf("router: consumer %q: declaring its queue for topic %q: %w", name, topic, err)
			}
		}
	}
	r.names[name]++
	handlerName := name
	if n := r.names[name]; n > 1 {
		handlerName = fmt.Sprintf("%s-%d", name, n)
	}
	return sub, handlerName, nil
}

// NewInbox is inbox.New with what the router's broker knows filled in where cfg leaves it
// unset: BrokerSideFields (refused as keys, stripped from dead letters) and Redelivery (the
// broker's redelivery signal, which lets the inbox count first deliveries only after a
// failure; see docs/adapters.md for what each broker's signal is worth), and Config.Batch
// (group commit) when cfg.Batch is zero. Errors are inbox.New's.
func (r *Router) NewInbox(cfg inbox.Config, logger watermill.LoggerAdapter) (*inbox.Inbox, error) {
	if cfg.BrokerSideFields == nil {
		cfg.BrokerSideFields = r.Broker.BrokerSideFields
	}
	if cfg.Redelivery == nil {
		cfg.Redelivery = r.Broker.Redelivery
	}
	if cfg.Batch == (inbox.BatchConfig{}) {
		cfg.Batch = r.batch
	}
	return inbox.New(cfg, logger)
}

// AddConsumer subscribes ib's handler h to topic in ib's consumer group (see subscriberFor):
// every consumer name gets every message of the topic, several AddConsumer calls (or routers,
// or processes) with one consumer name share them. The inbox wraps h directly, inside the
// handler function the router sees, so every router-level and handler-level middleware, added
// before or after this call, runs outside the inbox transaction. The handler is named after the
// consumer name ("<name>-2"... for further handlers of it). Errors: the consumer group's
// subscriber could not be built (the group is not a valid name for the broker, the broker is
// unreachable), or adapters.ErrNoFanOut (see subscriberFor).
func (r *Router) AddConsumer(ib *inbox.Inbox, topic string, h message.NoPublishHandlerFunc) (*message.Handler, error) {
	sub, name, err := r.subscriberFor(ib.ConsumerName(), topic)
	if err != nil {
		return nil, err
	}
	wrapped := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
	return r.AddConsumerHandler(name, topic, sub, func(msg *message.Message) error {
		_, err := wrapped(msg)
		return err
	}), nil
}

// AddHandler is AddConsumer for a handler that returns messages for publishTopic; give the
// inbox an Outbox (package middleware/outbox) so they are written in the inbox transaction.
func (r *Router) AddHandler(ib *inbox.Inbox, topic, publishTopic string, h message.HandlerFunc) (*message.Handler, error) {
	sub, name, err := r.subscriberFor(ib.ConsumerName(), topic)
	if err != nil {
		return nil, err
	}
	return r.Router.AddHandler(name, topic, sub, publishTopic, r.Broker.Publisher, ib.Middleware(h)), nil
}

// Close closes the router, then the consumers' subscribers, then the broker, and returns the
// first error.
func (r *Router) Close() error {
	err := r.Router.Close()
	r.closeWorkers()
	r.mu.Lock()
	subs := r.subs
	r.subs = map[string]message.Subscriber{}
	r.mu.Unlock()
	for _, s := range subs {
		if serr := s.Close(); err == nil {
			err = serr
		}
	}
	if berr := r.Broker.Close(); err == nil {
		err = berr
	}
	return err
}

// Run runs the router until ctx is cancelled or Close is called.
func (r *Router) Run(ctx context.Context) error { r.runWorkers(ctx); return r.Router.Run(ctx) }
