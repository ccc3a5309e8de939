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

// Name is the adapter's name in router configuration.
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
// schema initialisation, under an advisory lock). Its NewSubscriber gives each consumer group
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
	schema := sql.DefaultPostgreSQLSchema{
		GeneratePayloadType: func(string) string { return "BYTEA" },
		SubscribeBatchSize:  cfg.BatchSize,
	}
	pub, err := sql.NewPublisher(sql.BeginnerFromPgx(cfg.Pool), sql.PublisherConfig{
		SchemaAdapter:        schema,
		AutoInitializeSchema: true,
	}, logger)
	if err != nil {
		return nil, fmt.Errorf("postgres adapter: publisher: %w", err)
	}
	newSub := func(group string) (message.Subscriber, error) {
		if group == "" {
			return nil, fmt.Errorf("%w: postgres adapter: empty consumer group", inbox.ErrInvalidConfig)
		}
		deadline := cfg.AckDeadline
		sub, err := sql.NewSubscriber(sql.BeginnerFromPgx(cfg.Pool), sql.SubscriberConfig{
			ConsumerGroup:    group,
			SchemaAdapter:    schema,
			OffsetsAdapter:   sql.DefaultPostgreSQLOffsetsAdapter{},
			InitializeSchema: true,
			PollInterval:     cfg.PollInterval,
			ResendInterval:   cfg.ResendInterval,
			RetryInterval:    time.Second,
			AckDeadline:      &deadline,
		}, logger)
		if err != nil {
			return nil, fmt.Errorf("postgres adapter: subscriber of consumer group %q: %w", group, err)
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
