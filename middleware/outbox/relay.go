package outbox

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"hash/maphash"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Defaults applied by RelayConfig.setDefaults.
const (
	// DefaultBatchSize is watermill-sql's SubscribeBatchSize default: rows read per relay
	// transaction. Their offsets are acknowledged when the whole batch has been forwarded, so a
	// crash republishes up to one batch.
	DefaultBatchSize = 100
	// DefaultPollInterval is the pause after a poll that found no row to forward: the longest
	// delay, on an idle relay, between an inbox commit and the relay seeing its rows.
	DefaultPollInterval = 250 * time.Millisecond
	// DefaultRetryInterval is the pause after a failed poll (e.g. PostgreSQL unreachable).
	DefaultRetryInterval = time.Second
	// DefaultResendInterval is the pause before a row whose publish failed is published again.
	DefaultResendInterval = time.Second
	// DefaultAckDeadline is watermill-sql's: how long one message may take to be published;
	// past it the batch ends unacknowledged at that message and it is published again.
	DefaultAckDeadline = 30 * time.Second
	// DefaultCloseTimeout is how long Close waits for in-flight publishes (forwarder's default).
	DefaultCloseTimeout = 30 * time.Second
	// DefaultMaxInFlight is how many publishes the relay keeps waiting for the broker's
	// confirmation at once. One publish at a time costs a broker round trip per message
	// (a RabbitMQ publisher confirm, a Kafka produce request, a JetStream PubAck); 16 in flight
	// let the relay keep up with a consumer several times faster than that (docs/operations.md).
	DefaultMaxInFlight = 16
)

// maxConsumerGroupChars is the length of watermill-sql's consumer_group column, VARCHAR(255).
const maxConsumerGroupChars = 255

// RelayConfig configures a Relay. Zero values take the defaults documented on each field.
type RelayConfig struct {
	// Config names the outbox the relay reads; it must equal the Outbox's.
	Config

	// Pool is the PostgreSQL connection pool the relay's watermill-sql subscriber reads the
	// outbox with. The relay holds one connection while it polls or forwards a batch. Exactly
	// one of Pool and MySQL is required.
	Pool *pgxpool.Pool
	// MySQL is the MySQL or MariaDB database (go-sql-driver/mysql) the relay reads the outbox
	// with, through watermill-sql's MySQL queue schema and adapter, instead of Pool: the
	// outbox of sqlstore's MySQL dialect. Relayed rows are deleted; ConsumerGroup must be
	// empty (the queue has no consumer groups). The relay holds one connection while it polls
	// or forwards a batch; its polls are SERIALIZABLE (watermill-sql's choice for MySQL, see
	// the package documentation).
	MySQL *stdsql.DB
	// Publisher publishes the unwrapped messages to their destination topics: the real broker
	// (required). The relay never closes it.
	Publisher message.Publisher

	// ConsumerGroup is the watermill-sql consumer group whose offset the relay advances (at most
	// 255 characters of valid UTF-8, no NUL). Default: "" (watermill-sql's default group).
	// Relays sharing a group share the work: one forwards while the others wait on the group's
	// offset row (see the package documentation). A relay with another group forwards every
	// row again, from the start of the table.
	ConsumerGroup string
	// BatchSize is the number of rows read and forwarded per relay transaction. Default:
	// DefaultBatchSize. 1 republishes at most one message after a crash, at the cost of one
	// transaction per message.
	BatchSize int
	// MaxInFlight is the number of publishes of a batch the relay starts without waiting for
	// the previous ones' broker confirmation. Every publish of a batch must succeed before the
	// batch's offset is committed; when one fails, the batch is rolled back and all its rows
	// are published again after ResendInterval (at least once, never lost). Default:
	// DefaultMaxInFlight. 1 publishes one row at a time, in the table's commit order, and
	// retries a failed publish before any later row (strict order, the slowest).
	//
	// With more than 1, publishes run concurrently through RelayConfig.Publisher, so the
	// broker may receive rows of one batch in another order than the table's, unless
	// OrderingKey puts them in one lane. Publisher must be safe for concurrent use (Watermill's
	// publishers are); on RabbitMQ give it a channel pool at least this large
	// (adapters/amqp Config.PublishChannelPoolSize), or each publish opens a channel.
	MaxInFlight int
	// OrderingKey, when set, names the ordering lane of each message the relay publishes
	// (topic is its destination topic): messages of one lane are published one after another,
	// in the table's order, each after the broker confirmed the previous; lanes run in
	// parallel, up to MaxInFlight publishes in all. E.g. return the Kafka partition key, or
	// topic+entity ID, for what must stay ordered. Nil: no lanes (any order within a batch).
	OrderingKey func(topic string, msg *message.Message) string
	// OnBatch, when set, is called after each relay transaction that published or skipped
	// something, committed or rolled back, from the relay's goroutine: keep it quick (update
	// metrics). See also Relay.Stats and Relay.Lag.
	OnBatch func(RelayBatch)
	// OnMalformedRow, when set, is called for each outbox row the relay cannot read as a
	// forwarder envelope (written by something else than Outbox.Store), after the relay
	// logged it at ERROR with its offset. Keep it quick.
	OnMalformedRow func(MalformedRow)
	// PollInterval is the pause after a poll that found nothing. Default: DefaultPollInterval.
	PollInterval time.Duration
	// RetryInterval is the pause after a failed poll. Default: DefaultRetryInterval.
	RetryInterval time.Duration
	// ResendInterval is the pause before republishing a message whose publish failed.
	// Default: DefaultResendInterval.
	ResendInterval time.Duration
	// AckDeadline bounds the publish of one message (its context's deadline). Default:
	// DefaultAckDeadline. Must not be negative.
	AckDeadline time.Duration
	// CloseTimeout bounds Close's wait for in-flight publishes. Default: DefaultCloseTimeout.
	CloseTimeout time.Duration
	// AckWhenCannotUnwrap acknowledges (drops, with an error log) a row that is not a forwarder
	// envelope, instead of retrying it forever, which stops the relay's consumer group at that
	// row. Rows written by Outbox.Store are always valid envelopes. Default: false.
	AckWhenCannotUnwrap bool
	// Middlewares wrap the forwarding handler (components/forwarder's Config.Middlewares),
	// the first outermost. A middleware that returns nil without calling the handler drops the
	// message. They run inside the subscriber's REPEATABLE READ transaction (see the package
	// documentation): do not write through it.
	Middlewares []message.HandlerMiddleware
}

func (c *RelayConfig) setDefaults() {
	c.Config.setDefaults()
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.RetryInterval == 0 {
		c.RetryInterval = DefaultRetryInterval
	}
	if c.ResendInterval == 0 {
		c.ResendInterval = DefaultResendInterval
	}
	if c.AckDeadline == 0 {
		c.AckDeadline = DefaultAckDeadline
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = DefaultCloseTimeout
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
}

// Validate returns an error wrapping inbox.ErrInvalidConfig for an invalid Config, neither or
// both of Pool and MySQL, a missing Publisher, an invalid ConsumerGroup (any but "" with
// MySQL), a BatchSize or MaxInFlight below 1 or a
// negative duration.
// NewRelay calls it after filling defaults.
func (c RelayConfig) Validate() error {
	if err := c.Config.Validate(); err != nil {
		return err
	}
	if (c.Pool == nil) == (c.MySQL == nil) {
		return fmt.Errorf("%w: outbox relay: exactly one of Pool and MySQL is required", inbox.ErrInvalidConfig)
	}
	if c.Publisher == nil {
		return fmt.Errorf("%w: outbox relay: Publisher is required", inbox.ErrInvalidConfig)
	}
	if !utf8.ValidString(c.ConsumerGroup) || strings.IndexByte(c.ConsumerGroup, 0) >= 0 ||
		utf8.RuneCountInString(c.ConsumerGroup) > maxConsumerGroupChars {
		return fmt.Errorf("%w: outbox relay: ConsumerGroup must be valid UTF-8 without NUL, at most %d characters",
			inbox.ErrInvalidConfig, maxConsumerGroupChars)
	}
	if c.MySQL != nil && c.ConsumerGroup != "" {
		return fmt.Errorf("%w: outbox relay: the MySQL outbox is a queue without consumer groups: ConsumerGroup must be empty", inbox.ErrInvalidConfig)
	}
	if c.BatchSize < 1 {
		return fmt.Errorf("%w: outbox relay: BatchSize must be at least 1", inbox.ErrInvalidConfig)
	}
	if c.MaxInFlight < 1 {
		return fmt.Errorf("%w: outbox relay: MaxInFlight must be at least 1", inbox.ErrInvalidConfig)
	}
	if c.PollInterval < 0 || c.RetryInterval < 0 || c.ResendInterval < 0 || c.AckDeadline < 0 || c.CloseTimeout < 0 {
		return fmt.Errorf("%w: outbox relay: durations must not be negative", inbox.ErrInvalidConfig)
	}
	return nil
}

// ErrRelayClosed is returned by Run after Close.
var ErrRelayClosed = errors.New("outbox relay: closed")

// Relay forwards the outbox to the broker with Watermill's components/forwarder: a
// watermill-sql v4 Subscriber on the pool reads the outbox topic in order, the forwarder
// unwraps each envelope and publishes the original message (same UUID, payload and metadata)
// to its destination topic with RelayConfig.Publisher, and the row is acknowledged (the
// consumer group's offset advanced and committed) only after that publish returned.
//
// Delivery is at least once, never at most once: a crash, a failed commit or a Close between
// a publish and the commit of its batch's offset publishes the message again, with the same
// UUID, when a relay next reads the group. Consumers must deduplicate, which an inbox keyed
// on the message UUID (the default) does.
type Relay struct {
	cfg    RelayConfig
	sub    *wmsql.Subscriber
	fwd    *forwarder.Forwarder
	logger watermill.LoggerAdapter

	slots    chan struct{} // one token per publish in flight, MaxInFlight
	laneSeed maphash.Seed
	stats    relayCounters
	closing  chan struct{} // closed by Close
	closeOne sync.Once

	runDone chan struct{} // closed when the forwarder's Run returned

	mu      sync.Mutex
	started bool // Run called and past its checks: the forwarder's router owns the subscriber
	closed  bool
}

// NewRelay returns a Relay, or an error wrapping inbox.ErrInvalidConfig. A nil logger
// discards logs; fields that could carry payloads or metadata are removed from what
// Watermill's components log through it. NewRelay does not touch the database.
func NewRelay(cfg RelayConfig, logger watermill.LoggerAdapter) (*Relay, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	logger = redact(logger).With(watermill.LogFields{"outbox_topic": cfg.Topic})
	r := &Relay{
		cfg:      cfg,
		logger:   logger,
		slots:    make(chan struct{}, cfg.MaxInFlight),
		laneSeed: maphash.MakeSeed(),
		closing:  make(chan struct{}),
		runDone:  make(chan struct{}),
	}
	ackDeadline := cfg.AckDeadline
	subCfg := wmsql.SubscriberConfig{
		ConsumerGroup:  cfg.ConsumerGroup,
		AckDeadline:    &ackDeadline,
		PollInterval:   cfg.PollInterval,
		ResendInterval: cfg.ResendInterval,
		RetryInterval:  cfg.RetryInterval,
		SchemaAdapter:  relaySchema{cfg.schemaAdapter(cfg.BatchSize)},
		OffsetsAdapter: cfg.offsetsAdapter(),
		// InitializeSchema outside the subscriber: see the package-level InitializeSchema.
		InitializeSchema: false,
	}
	var db wmsql.Beginner = relayDB{pool: cfg.Pool, relay: r}
	if cfg.MySQL != nil {
		db = mysqlRelayDB{db: cfg.MySQL, relay: r}
		subCfg.SchemaAdapter = mysqlRelaySchema{cfg.mysqlSchemaAdapter(cfg.BatchSize)}
		subCfg.OffsetsAdapter = cfg.mysqlOffsetsAdapter()
	}
	sub, err := wmsql.NewSubscriber(db, subCfg, logger)
	if err != nil {
		return nil, fmt.Errorf("outbox relay: creating the SQL subscriber: %w", err)
	}
	fwd, err := forwarder.NewForwarder(sub, pipelinePublisher{relay: r, pub: cfg.Publisher}, logger, forwarder.Config{
		ForwarderTopic:      cfg.Topic,
		Middlewares:         append([]message.HandlerMiddleware{r.malformedRows}, cfg.Middlewares...),
		CloseTimeout:        cfg.CloseTimeout,
		AckWhenCannotUnwrap: cfg.AckWhenCannotUnwrap,
	})
	if err != nil {
		_ = sub.Close()
		return nil, fmt.Errorf("outbox relay: creating the forwarder: %w", err)
	}
	r.sub, r.fwd = sub, fwd
	return r, nil
}

// Run forwards the outbox until ctx is cancelled or Close is called, then returns nil once
// in-flight publishes finished (bounded by CloseTimeout). It first checks that the outbox
// tables exist (an error tells you to call InitializeSchema) and registers the consumer group
// (watermill-sql's "zero offset" row). Run may be called once; it returns ErrRelayClosed after
// Close.
func (r *Relay) Run(ctx context.Context) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return ErrRelayClosed
	}
	if r.started {
		r.mu.Unlock()
		return errors.New("outbox relay: already running")
	}
	if err := r.checkTables(ctx); err != nil {
		r.mu.Unlock()
		return err
	}
	r.started = true
	r.mu.Unlock()
	defer close(r.runDone)
	if err := r.fwd.Run(ctx); err != nil {
		return fmt.Errorf("outbox relay: %w", err)
	}
	return nil
}

// checkTables fails fast, before the forwarder's router starts, when InitializeSchema has not
// run: the router cannot be closed cleanly after a failed start.
func (r *Relay) checkTables(ctx context.Context) error {
	if r.cfg.MySQL != nil {
		return r.checkMySQLTables(ctx)
	}
	for _, t := range []string{r.cfg.MessagesTable(), r.cfg.OffsetsTable()} {
		if _, err := r.cfg.Pool.Exec(ctx, "SELECT FROM "+t+" LIMIT 0"); err != nil {
			return fmt.Errorf("outbox relay: table %s is not usable (call outbox.InitializeSchema first): %w", t, err)
		}
	}
	return nil
}

// Running returns a channel that is closed once Run has subscribed to the outbox
// (components/forwarder's Running, i.e. the router's). Like the router's, it stays closed
// after the relay stopped.
func (r *Relay) Running() chan struct{} { return r.fwd.Running() }

// Close stops the relay: it closes the forwarder's router, which waits up to CloseTimeout for
// the in-flight publish, and the SQL subscriber. Rows published in the batch that was in
// flight may be published again by the next relay (at least once). Close is idempotent.
func (r *Relay) Close() error {
	r.mu.Lock()
	started := r.started
	r.closed = true
	r.mu.Unlock()
	r.closeOne.Do(func() { close(r.closing) })
	var err error
	if started {
		// Closing the router before it runs would wait CloseTimeout for handlers that never
		// started, so wait for it to run, or for Run to have failed before it ran.
		running := false
		select {
		case <-r.fwd.Running():
			running = true
		case <-r.runDone:
			select {
			case <-r.fwd.Running():
				running = true
			default:
			}
		}
		if running {
			if cerr := r.fwd.Close(); cerr != nil {
				err = fmt.Errorf("outbox relay: closing the forwarder: %w", cerr)
			}
		}
	}
	if cerr := r.sub.Close(); cerr != nil {
		err = errors.Join(err, fmt.Errorf("outbox relay: closing the SQL subscriber: %w", cerr))
	}
	return err
}
