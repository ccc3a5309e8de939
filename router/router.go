// Package router builds a Watermill router for inbox-wrapped handlers from configuration: the
// broker is a configuration value (INBOX_BROKER, or a JSON file), so a handler moves between
// PostgreSQL, RabbitMQ, Kafka, SQS, NATS JetStream and Redis Streams without a code change.
// A broker name is known once its adapter package is imported (it registers itself, as
// database/sql drivers do): import the adapters you may configure, or adapters/all for every
// one. The router links no broker client of its own.
//
//	import _ "github.com/watermill-inbox/watermill-inbox/adapters/amqp" // registers "amqp"
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
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// DefaultBroker is the broker of a Config that names none.
const DefaultBroker = "postgres"

// Config selects and addresses the broker.
type Config struct {
	// Broker is a registered adapter's name (adapters.Registered): "postgres" (default),
	// "amqp", "kafka", "sqs", "nats" or "redis" once its adapter package is imported.
	Broker string `json:"broker"`
	// URL is the broker's address, as the adapter reads it (its package's Driver doc). For
	// "postgres" it is unused: the pool passed to New is the broker. For "amqp" it is the AMQP
	// URI. For "kafka" it is the bootstrap brokers, comma-separated host:port, optionally
	// behind kafka:// (kafka://k1:9092,k2:9092). For "sqs" it is optional: an endpoint that
	// replaces the one AWS resolves from the region (e.g. a local SQS-compatible endpoint);
	// region and credentials come from the AWS SDK's default resolution (AWS_REGION,
	// AWS_ACCESS_KEY_ID, AWS_PROFILE, instance roles...). For "nats" it is the NATS URL
	// (nats://127.0.0.1:4222), for "redis" the Redis URL (redis://127.0.0.1:6379/0). Empty:
	// the adapter's local default (amqp, nats, redis).
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

	// Settings maps a broker name to that adapter's own settings beyond the address and the
	// consumer group (timings, concurrency, queue arguments): a postgres.Config, amqp.Config,
	// kafka.Config, sqs.BrokerConfig, nats.Config or redis.Config, as a value or a pointer.
	// NewBroker passes the configured broker's entry to its adapter, which fills in what the
	// fields above decide (Pool, URL, Brokers, ConsumerGroup, the SQS endpoint and protocol).
	// No entry: the adapter's defaults. Set in code, never read from JSON or the environment.
	//
	//	cfg.Settings = map[string]any{amqp.Name: amqp.Config{Prefetch: 8}}
	Settings map[string]any `json:"-"`

	// Batch turns on group commit (inbox.BatchConfig) for every inbox NewInbox builds whose
	// own Config.Batch is left zero: deliveries the broker hands out at once share one
	// transaction. A batch is only as big as the broker's concurrency (docs/design.md,
	// "Batched mode"). Set in code, or with INBOX_BATCH_SIZE and INBOX_BATCH_LINGER (a Go
	// duration such as 2ms) through ConfigFromEnv. Default: off.
	Batch inbox.BatchConfig `json:"-"`

	source int    // sourceCode, sourceEnv or sourceJSON
	path   string // the JSON file, for sourceJSON
}

// DefaultConsumerGroup names, after ConsumerGroupPrefix, the consumer group of
// Router.Broker.Subscriber (the broker's default subscriber, for tools such as a dead-letter
// reader). Consumers added with AddConsumer and AddPublishingConsumer use their consumer name
// instead.
const DefaultConsumerGroup = "watermill-inbox"

// Where a Config came from, so that its errors name the setting the user wrote.
const (
	sourceCode = iota
	sourceEnv
	sourceJSON
)

// envSQSQueryProtocol selects Config.SQSQueryProtocol in ConfigFromEnv.
const envSQSQueryProtocol = "INBOX_SQS_QUERY_PROTOCOL"

// ConfigFromEnv reads INBOX_BROKER, INBOX_BROKER_URL, INBOX_CONSUMER_GROUP_PREFIX,
// INBOX_SQS_QUERY_PROTOCOL (1, true, 0, false...), INBOX_MODE, INBOX_BATCH_SIZE and
// INBOX_BATCH_LINGER. When INBOX_BROKER_URL is unset, the adapter's own variable
// (adapters.Driver.URLEnv: INBOX_AMQP_URL, INBOX_NATS_URL, INBOX_REDIS_URL) is the URL, and
// without it the adapter's local default. Errors wrap inbox.ErrInvalidConfig and name the
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
		if d, ok := adapters.Lookup(brokerName(cfg.Broker)); ok && d.URLEnv != "" {
			cfg.URL = os.Getenv(d.URLEnv)
		}
	}
	if v := os.Getenv(envSQSQueryProtocol); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return cfg, fmt.Errorf("%w: router: %s=%q, want 1 or 0", inbox.ErrInvalidConfig, envSQSQueryProtocol, v)
		}
		cfg.SQSQueryProtocol = b
	}
	if err := batchFromEnv(&cfg); err != nil {
		return cfg, err
	}
	cfg.setDefaults()
	return cfg, cfg.Validate()
}

// LoadConfig reads a JSON file with the fields of Config, e.g.
// {"broker": "amqp", "url": "amqp://guest:guest@127.0.0.1:5672/"}. A missing "url" is the
// adapter's local default (amqp, nats, redis). Errors wrap inbox.ErrInvalidConfig and name
// the JSON field and the file. A file that could be read two ways is refused: a field given
// twice, a field whose name differs from one of Config's only in case, an unknown field,
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

// brokerName is a configured broker name as the registry knows it.
func brokerName(s string) string {
	s = strings.ToLower(strings.TrimSpace(s))
	if s == "" {
		return DefaultBroker
	}
	return s
}

func (c *Config) setDefaults() {
	c.Broker = brokerName(c.Broker)
	c.setModeDefault()
	if c.URL == "" {
		if d, ok := adapters.Lookup(c.Broker); ok {
			c.URL = d.DefaultURL
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

// Validate returns an error wrapping inbox.ErrInvalidConfig for an unknown mode, a broker no
// imported adapter registered (the error lists the registered ones) or a URL the adapter
// refuses (for kafka, a missing one: it has no local default). The error names the setting as
// it was given: the environment variable (ConfigFromEnv), the JSON field and file
// (LoadConfig), or the Config field.
func (c Config) Validate() error {
	if err := c.validateMode(); err != nil {
		return err
	}
	name := brokerName(c.Broker)
	d, ok := adapters.Lookup(name)
	if !ok {
		return fmt.Errorf("%w: router: unknown broker %q in %s (registered: %s; import its adapter package, or adapters/all)",
			inbox.ErrInvalidConfig, name, c.setting("INBOX_BROKER", "broker", "Broker"), strings.Join(adapters.Registered(), ", "))
	}
	if d.ValidateURL != nil {
		if err := d.ValidateURL(c.URL); err != nil {
			return fmt.Errorf("%w: router: broker %q: %s: %w", inbox.ErrInvalidConfig, name, c.setting("INBOX_BROKER_URL", "url", "URL"), err)
		}
	}
	return nil
}

// NewBroker builds the configured broker through its registered adapter. pool is the
// database the inbox uses; the postgres broker uses it too. Its Subscriber consumes in
// consumer group cfg.ConsumerGroupPrefix+DefaultConsumerGroup (for amqp and sqs: the queue
// named after the topic). Errors: Validate's, then the adapter's.
func NewBroker(cfg Config, pool *pgxpool.Pool, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	d, _ := adapters.Lookup(cfg.Broker)
	return d.Open(adapters.Spec{
		URL: cfg.URL, ConsumerGroup: cfg.ConsumerGroupPrefix + DefaultConsumerGroup, Pool: pool,
		QueryProtocol: cfg.SQSQueryProtocol, Settings: cfg.Settings[cfg.Broker],
	}, logger)
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
	// Watermill's Close waits its CloseTimeout (30 s) for every added handler that never ran:
	// Close skips it when the router was never run, or Run failed before the router ran.
	runCalled, startFailed, closed bool
	subs                           map[string]message.Subscriber // consumer group -> its subscriber
	names                          map[string]int                // consumer name -> handlers added for it
	topics                         map[string]string             // topic -> consumer name, on a broker without fan-out
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
// When the broker asks for it (adapters.Broker.SubscribeInitialize: amqp declares the group's
// queue and binds it to the topic), it calls SubscribeInitialize at once, so messages
// published between AddConsumer and Run are kept for the group.
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
	if r.Broker.SubscribeInitialize {
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

// AddPublishingConsumer is AddConsumer for a handler that returns messages for publishTopic;
// give the inbox an Outbox (package middleware/outbox) so they are written in the inbox
// transaction. (r.AddHandler is Watermill's own, promoted from the embedded *message.Router.)
func (r *Router) AddPublishingConsumer(ib *inbox.Inbox, topic, publishTopic string, h message.HandlerFunc) (*message.Handler, error) {
	sub, name, err := r.subscriberFor(ib.ConsumerName(), topic)
	if err != nil {
		return nil, err
	}
	return r.Router.AddHandler(name, topic, sub, publishTopic, r.Broker.Publisher, ib.Middleware(h)), nil
}

// Close closes the router, then the consumers' subscribers, then the broker, and returns the
// first error.
func (r *Router) Close() error {
	r.mu.Lock()
	running := r.runCalled && !r.startFailed
	r.closed = true
	r.mu.Unlock()
	var err error
	if running {
		err = r.Router.Close()
	}
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

// Run runs the router until ctx is cancelled or Close is called. A subscription that fails
// (an unreachable broker, a postgres topic whose table or grant is missing) makes it return at
// once with that error, wrapped without the stack frames Watermill attaches; Close then
// returns at once too.
func (r *Router) Run(ctx context.Context) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return errors.New("router: closed")
	}
	r.runCalled = true
	r.mu.Unlock()
	r.runWorkers(ctx)
	err := r.Router.Run(ctx)
	if err == nil {
		return nil
	}
	select {
	case <-r.Router.Running():
	default: // failed before running: no handler of Watermill's is left to wait for
		r.mu.Lock()
		r.startFailed = true
		r.mu.Unlock()
	}
	return fmt.Errorf("router: %w", err) // fmt's wrapping prints no stack frames with %+v
}
