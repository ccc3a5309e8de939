// Package postgres uses PostgreSQL itself as the broker, through watermill-sql v4: messages are
// rows of a per-topic table, and each consumer group's position is an offset row.
//
// The Nack hazard of watermill-sql: its subscriber consumes inside its own REPEATABLE READ
// transaction and, on Nack, re-sends the message inside that same transaction, so writes made
// in it by a failed attempt are not rolled back (upstream issue ThreeDotsLabs/watermill-sql#224).
// The inbox never writes in the subscriber's transaction: it claims and runs the handler in its
// own transaction on another pool connection, so a failed attempt leaves nothing behind. Do
// not join the subscriber's transaction (sql.TxFromContext) from an inbox-wrapped handler.
//
// Payloads are stored as BYTEA, so any payload works (watermill-sql's default is JSON).
package postgres

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Name is the adapter's name in router configuration, registered when the package is imported
// (driver.go).
const Name = "postgres"

// BrokerSideFields: watermill-sql sets no delivery metadata; its offsets stay internal (the
// table is internal/brokerside.Postgres).
var BrokerSideFields = brokerside.Postgres

// Config configures the PostgreSQL broker.
type Config struct {
	// Pool is the connection pool (required). The subscriber holds one connection per
	// subscription while it polls; the inbox needs its own connections besides.
	Pool *pgxpool.Pool
	// ConsumerGroup names the subscriber's offset row (required): consumers in one group share
	// the stream, each group gets every message.
	ConsumerGroup string
	// PollInterval is the pause between polls that found nothing. Default: 100 ms.
	PollInterval time.Duration
	// ResendInterval is the pause before a nacked message is sent again. Default: 100 ms.
	ResendInterval time.Duration
	// AckDeadline is how long a message may stay unacked before the subscriber gives up on it
	// and redelivers. Default: 30 s (watermill-sql's).
	AckDeadline time.Duration
	// BatchSize is how many rows a poll reads; a crash redelivers up to that many. Default: 10.
	BatchSize int
	// Schema holds the topic tables (Tables). Default: "" (where the connection's search_path
	// finds them, and creates them).
	Schema string
	// NoDDL makes the broker run no DDL, for a role that cannot create tables: watermill-sql's
	// CREATE TABLE IF NOT EXISTS, run on a topic's first publish and on every subscribe
	// (PostgreSQL checks the CREATE privilege before it sees the table exists), is off. The
	// schema's owner creates the topic tables beforehand (Migrate, `watermill-inbox migrate
	// --broker-topics ...`, printed with --print) and grants them (GrantSQL, `watermill-inbox
	// grants --broker-topics ...`). Before a topic's first publish and before each subscribe
	// the broker checks them (CheckTopic): a missing table or privilege fails that call at
	// once with an error wrapping ErrTopicNotReady and inbox.ErrInvalidConfig that names it.
	// Default: false (the broker creates the tables it needs).
	NoDDL bool
}

func (c *Config) setDefaults() {
	if c.PollInterval == 0 {
		c.PollInterval = 100 * time.Millisecond
	}
	if c.ResendInterval == 0 {
		c.ResendInterval = 100 * time.Millisecond
	}
	if c.AckDeadline == 0 {
		c.AckDeadline = 30 * time.Second
	}
	if c.BatchSize == 0 {
		c.BatchSize = 10
	}
}

// Validate returns an error wrapping inbox.ErrInvalidConfig for a nil Pool, an empty
// ConsumerGroup or negative durations.
func (c Config) Validate() error {
	switch {
	case c.Pool == nil:
		return fmt.Errorf("%w: postgres adapter: Pool is required", inbox.ErrInvalidConfig)
	case c.ConsumerGroup == "":
		return fmt.Errorf("%w: postgres adapter: ConsumerGroup is required", inbox.ErrInvalidConfig)
	case c.PollInterval < 0 || c.ResendInterval < 0 || c.AckDeadline < 0 || c.BatchSize < 0:
		return fmt.Errorf("%w: postgres adapter: negative interval or batch size", inbox.ErrInvalidConfig)
	}
	return nil
}

// New returns the broker. Tables are created on first publish or subscribe (watermill-sql's
// schema initialisation, under an advisory lock), unless NoDDL: then they are checked
// (CheckTopic) and must exist. Its NewSubscriber gives each consumer group
// an offset row of its own in the topic's offsets table: every group reads every message, and
// a group that subscribes for the first time starts at the topic's first message (nothing
// published before is missed). Redelivery is adapters.UnknownRedelivery: watermill-sql
// exposes no delivery count, and a nacked message is re-sent in process. The logger is
// wrapped so that payloads and metadata (watermill-sql's query_args) are never logged; a nil
// logger discards logs.
func New(cfg Config, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	// watermill-sql logs every statement's arguments (payloads and metadata) as query_args
	// at trace level: they never reach the user's logger.
	logger = redact.Logger(logger)
	schema := cfg.schemaAdapter()
	var pub message.Publisher
	pub, err := sql.NewPublisher(sql.BeginnerFromPgx(cfg.Pool), sql.PublisherConfig{
		SchemaAdapter:        schema,
		AutoInitializeSchema: !cfg.NoDDL,
	}, logger)
	if err != nil {
		return nil, fmt.Errorf("postgres adapter: publisher: %w", err)
	}
	if cfg.NoDDL {
		pub = adapters.DeclaringPublisher(pub, func(topic string) error {
			return CheckTopic(context.Background(), cfg.Pool, cfg, topic, forPublish)
		})
	}
	newSub := func(group string) (message.Subscriber, error) {
		if group == "" {
			return nil, fmt.Errorf("%w: postgres adapter: empty consumer group", inbox.ErrInvalidConfig)
		}
		deadline := cfg.AckDeadline
		sub, err := sql.NewSubscriber(sql.BeginnerFromPgx(cfg.Pool), sql.SubscriberConfig{
			ConsumerGroup:    group,
			SchemaAdapter:    schema,
			OffsetsAdapter:   cfg.offsetsAdapter(),
			InitializeSchema: !cfg.NoDDL,
			PollInterval:     cfg.PollInterval,
			ResendInterval:   cfg.ResendInterval,
			RetryInterval:    time.Second,
			AckDeadline:      &deadline,
		}, logger)
		if err != nil {
			return nil, fmt.Errorf("postgres adapter: subscriber of consumer group %q: %w", group, err)
		}
		if cfg.NoDDL {
			return checkingSubscriber{sub, cfg}, nil
		}
		return sub, nil
	}
	sub, err := newSub(cfg.ConsumerGroup)
	if err != nil {
		_ = pub.Close()
		return nil, err
	}
	return &adapters.Broker{
		Name: Name, Publisher: pub, Subscriber: sub, NewSubscriber: newSub,
		BrokerSideFields: BrokerSideFields, Redelivery: adapters.UnknownRedelivery,
	}, nil
}

// checkingSubscriber is a NoDDL broker's subscriber: it checks a topic's tables and privileges
// (CheckTopic) before subscribing, so a missing one fails Subscribe at once with an error that
// names it, instead of watermill-sql's retries of a query that cannot succeed.
type checkingSubscriber struct {
	message.Subscriber
	cfg Config
}

func (s checkingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := CheckTopic(ctx, s.cfg.Pool, s.cfg, topic, forSubscribe); err != nil {
		return nil, err
	}
	return s.Subscriber.Subscribe(ctx, topic)
}
