// Package router builds a Watermill router for inbox-wrapped handlers from configuration: the
// broker is a configuration value (INBOX_BROKER, or a JSON file), so a handler moves between
// PostgreSQL, RabbitMQ, NATS JetStream and Redis Streams without a code change.
//
//	cfg, err := router.ConfigFromEnv()        // INBOX_BROKER=amqp INBOX_BROKER_URL=amqp://...
//	r, err := router.New(cfg, pool, logger)
//	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing",
//		BrokerSideFields: r.Broker.BrokerSideFields}, logger)
//	r.AddConsumer(ib, "payments", func(msg *message.Message) error { ... })
//	err = r.Run(ctx)
package router

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"

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
	// ConsumerGroup is the consumer group of the subscriber where the broker has one
	// (postgres: the offset row; kafka: the consumer group; nats: the durable consumer and
	// deliver group, a valid JetStream consumer name; redis: the stream consumer group).
	// Default: "watermill-inbox".
	ConsumerGroup string `json:"consumer_group"`
	// SQSQueryProtocol makes the "sqs" broker speak the AWS query protocol instead of the
	// SDK's default JSON protocol. Amazon SQS speaks both: leave it off against AWS. Set it
	// for an SQS-compatible endpoint that speaks only the query protocol, such as goaws.
	SQSQueryProtocol bool `json:"sqs_query_protocol"`

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
	Redis *redis.Config `json:"-"`
}

// ConfigFromEnv reads INBOX_BROKER, INBOX_BROKER_URL, INBOX_CONSUMER_GROUP and
// INBOX_SQS_QUERY_PROTOCOL. When INBOX_BROKER_URL is unset, INBOX_AMQP_URL, INBOX_NATS_URL or
// INBOX_REDIS_URL is the URL of "amqp", "nats" or "redis".
func ConfigFromEnv() (Config, error) {
	cfg := Config{
		Broker:        os.Getenv("INBOX_BROKER"),
		URL:           os.Getenv("INBOX_BROKER_URL"),
		ConsumerGroup: os.Getenv("INBOX_CONSUMER_GROUP"),
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
	cfg.setDefaults()
	return cfg, cfg.Validate()
}

// LoadConfig reads a JSON file with the fields of Config, e.g.
// {"broker": "amqp", "url": "amqp://guest:guest@127.0.0.1:5672/"}.
func LoadConfig(path string) (Config, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("router: %w", err)
	}
	var cfg Config
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&cfg); err != nil {
		return Config{}, fmt.Errorf("%w: router: %s: %v", inbox.ErrInvalidConfig, path, err)
	}
	cfg.setDefaults()
	return cfg, cfg.Validate()
}

func (c *Config) setDefaults() {
	c.Broker = strings.ToLower(strings.TrimSpace(c.Broker))
	if c.Broker == "" {
		c.Broker = postgres.Name
	}
	if c.ConsumerGroup == "" {
		c.ConsumerGroup = "watermill-inbox"
	}
}

// Validate returns an error wrapping inbox.ErrInvalidConfig for an unknown broker or a missing
// or invalid URL.
func (c Config) Validate() error {
	switch c.Broker {
	case postgres.Name:
	case amqp.Name, nats.Name, redis.Name:
		if c.URL == "" {
			return fmt.Errorf("%w: router: broker %q needs a URL (INBOX_BROKER_URL)", inbox.ErrInvalidConfig, c.Broker)
		}
	case kafka.Name:
		if _, err := kafka.ParseBrokers(c.URL); err != nil {
			return fmt.Errorf("router: broker %q needs a URL (INBOX_BROKER_URL): %w", c.Broker, err)
		}
	case sqs.Name:
		return validateSQS(c)
	default:
		return fmt.Errorf("%w: router: unknown broker %q (one of %s)", inbox.ErrInvalidConfig, c.Broker, strings.Join(Brokers, ", "))
	}
	return nil
}

// NewBroker builds the configured broker. pool is the database the inbox uses; the postgres
// broker uses it too.
func NewBroker(cfg Config, pool *pgxpool.Pool, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
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
		c.Brokers, c.ConsumerGroup = brokers, cfg.ConsumerGroup
		return kafka.New(c, logger)
	case sqs.Name:
		return newSQSBroker(cfg, logger)
	case nats.Name:
		c := base(cfg.NATS)
		c.URL, c.ConsumerGroup = cfg.URL, cfg.ConsumerGroup
		return nats.New(c, logger)
	case redis.Name:
		c := base(cfg.Redis)
		c.URL, c.ConsumerGroup = cfg.URL, cfg.ConsumerGroup
		return redis.New(c, logger)
	default:
		c := base(cfg.Postgres)
		c.Pool, c.ConsumerGroup = pool, cfg.ConsumerGroup
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
}

// New builds the broker and a router whose router-level middleware is, outermost first,
// CorrelationID and Recoverer. Handlers added with AddConsumer and AddHandler get their inbox
// as the innermost middleware, so the ack always follows the inbox commit. Close closes the
// router and then the broker.
func New(cfg Config, pool *pgxpool.Pool, logger watermill.LoggerAdapter) (*Router, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	b, err := NewBroker(cfg, pool, logger)
	if err != nil {
		return nil, err
	}
	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		_ = b.Close()
		return nil, err
	}
	r.AddMiddleware(wmmiddleware.CorrelationID, wmmiddleware.Recoverer)
	return &Router{Router: r, Broker: b}, nil
}

// AddConsumer subscribes ib's handler h to topic: the handler is named after the inbox's
// consumer name and wrapped by the inbox.
func (r *Router) AddConsumer(ib *inbox.Inbox, topic string, h message.NoPublishHandlerFunc) *message.Handler {
	handler := r.AddConsumerHandler(ib.ConsumerName(), topic, r.Broker.Subscriber, h)
	handler.AddMiddleware(ib.Middleware)
	return handler
}

// AddHandler is AddConsumer for a handler that returns messages for publishTopic; give the
// inbox an Outbox (package middleware/outbox) so they are written in the inbox transaction.
func (r *Router) AddHandler(ib *inbox.Inbox, topic, publishTopic string, h message.HandlerFunc) *message.Handler {
	handler := r.Router.AddHandler(ib.ConsumerName(), topic, r.Broker.Subscriber, publishTopic, r.Broker.Publisher, h)
	handler.AddMiddleware(ib.Middleware)
	return handler
}

// Close closes the router, then the broker.
func (r *Router) Close() error {
	err := r.Router.Close()
	if berr := r.Broker.Close(); err == nil {
		err = berr
	}
	return err
}

// Run runs the router until ctx is cancelled or Close is called.
func (r *Router) Run(ctx context.Context) error { return r.Router.Run(ctx) }
