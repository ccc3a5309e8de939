//go:build unix

package main

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

const (
	// consumerName is the inbox's consumer name and the watermill-sql consumer group.
	consumerName = "billing"
	// sqlTopic is the watermill-sql topic. DefaultPostgreSQLSchema stores it in the unqualified
	// table "watermill_payments" (offsets in "watermill_offsets_payments"), which the pools'
	// search_path places in the run's own schema.
	sqlTopic = "payments"
	// messageType is stored in the inbox's message_type column (metadata "name").
	messageType = "PaymentReceived"
	// amqpPrefetch is the QoS prefetch of each AMQP subscription: deliveries the broker hands
	// out before they are acked, so several are in flight (unacked) at any moment.
	amqpPrefetch = 16
	// amqpQueueExpiry deletes a run's queue this long after its last consumer left, in case the
	// run fails before deleting it (RabbitMQ's x-expires, in milliseconds).
	amqpQueueExpiry = int32(10 * 60 * 1000)
)

// payment is the message payload: a producer-side payment of amountCents into an account.
type payment struct {
	AccountID   int64 `json:"account_id"`
	AmountCents int64 `json:"amount_cents"`
}

// openPool connects to the database with search_path set to schema, so watermill-sql's
// unqualified tables live in the run's schema, and with application_name set to appName, so the
// orchestrator can find the consumer's sessions in pg_stat_activity.
func openPool(ctx context.Context, schema, appName string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(databaseURL())
	if err != nil {
		return nil, fmt.Errorf("parse INBOX_DATABASE_URL: %w", err)
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("PostgreSQL is not reachable at %s: %w", redactURL(databaseURL()), err)
	}
	return pool, nil
}

// qualified returns the quoted name of a table in schema.
func qualified(schema, table string) string { return pgx.Identifier{schema, table}.Sanitize() }

// sqlSubscriber is the watermill-sql subscriber of the consumer. It reads up to 100 messages per
// batch inside one REPEATABLE READ transaction on its own connection and commits the consumer
// group's offset only after the whole batch was acked: a crash redelivers the batch.
func sqlSubscriber(pool *pgxpool.Pool, logger watermill.LoggerAdapter) (*sql.Subscriber, error) {
	return sql.NewSubscriber(sql.BeginnerFromPgx(pool), sql.SubscriberConfig{
		ConsumerGroup:    consumerName,
		SchemaAdapter:    sql.DefaultPostgreSQLSchema{},
		OffsetsAdapter:   sql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
		PollInterval:     50 * time.Millisecond,
		ResendInterval:   100 * time.Millisecond,
		RetryInterval:    200 * time.Millisecond,
	}, logger)
}

// sqlPublisher publishes into the run's schema (through the pool's search_path). Every row gets
// its own offset, so a message published twice with one UUID is stored, and delivered, twice.
func sqlPublisher(pool *pgxpool.Pool, logger watermill.LoggerAdapter) (*sql.Publisher, error) {
	return sql.NewPublisher(sql.BeginnerFromPgx(pool), sql.PublisherConfig{
		SchemaAdapter:        sql.DefaultPostgreSQLSchema{},
		AutoInitializeSchema: true,
	}, logger)
}

// amqpConfig is a durable queue named after the topic on the default exchange, with persistent
// messages, a prefetch of amqpPrefetch per subscription, transactional publishing (a Publish
// call returns after the broker committed the batch) and an expiry for abandoned queues.
func amqpConfig() amqp.Config {
	cfg := amqp.NewDurableQueueConfig(amqpURL())
	cfg.Queue.Arguments = map[string]any{"x-expires": amqpQueueExpiry}
	cfg.Consume.Qos.PrefetchCount = amqpPrefetch
	cfg.Publish.Transactional = true
	return cfg
}

// brokerAdmin is what the orchestrator needs from a broker: publish, see what is left, clean up.
type brokerAdmin interface {
	// Publish sends msgs to the run's topic, in order, in batches.
	Publish(msgs []*message.Message) error
	// Pending returns how many deliveries the broker still holds for the consumer.
	Pending(ctx context.Context) (int64, error)
	// PendingMeaning says what Pending counts, for the summary.
	PendingMeaning() string
	// Cleanup deletes the broker-side state of the run that the schema drop does not cover.
	Cleanup(ctx context.Context) error
	Close() error
}

const publishBatch = 250

func publishInBatches(pub message.Publisher, topic string, msgs []*message.Message) error {
	for start := 0; start < len(msgs); start += publishBatch {
		end := min(start+publishBatch, len(msgs))
		if err := pub.Publish(topic, msgs[start:end]...); err != nil {
			return fmt.Errorf("publish messages %d..%d: %w", start, end-1, err)
		}
	}
	return nil
}

// sqlAdmin is the watermill-sql broker: the messages and offsets tables in the run's schema.
type sqlAdmin struct {
	pool   *pgxpool.Pool
	pub    *sql.Publisher
	schema string
}

func newSQLAdmin(pool *pgxpool.Pool, schema string, logger watermill.LoggerAdapter) (*sqlAdmin, error) {
	pub, err := sqlPublisher(pool, logger)
	if err != nil {
		return nil, fmt.Errorf("watermill-sql publisher: %w", err)
	}
	return &sqlAdmin{pool: pool, pub: pub, schema: schema}, nil
}

func (a *sqlAdmin) Publish(msgs []*message.Message) error {
	return publishInBatches(a.pub, sqlTopic, msgs)
}

// Pending counts the rows after the consumer group's committed offset. The subscriber commits
// its offset at the end of each batch, so this is also what a crash would redeliver.
func (a *sqlAdmin) Pending(ctx context.Context) (int64, error) {
	msgs := qualified(a.schema, "watermill_"+sqlTopic)
	offsets := qualified(a.schema, "watermill_offsets_"+sqlTopic)
	var n int64
	err := a.pool.QueryRow(ctx, `
		SELECT count(*) FROM `+msgs+` m
		WHERE NOT EXISTS (
			SELECT 1 FROM `+offsets+` o
			WHERE o.consumer_group = $1
			  AND (m.transaction_id, m."offset") <= (o.last_processed_transaction_id, o.offset_acked))`,
		consumerName).Scan(&n)
	return n, err
}

func (a *sqlAdmin) PendingMeaning() string {
	return "rows after the consumer group's committed offset"
}

func (a *sqlAdmin) Cleanup(context.Context) error { return nil } // the tables go with the schema

func (a *sqlAdmin) Close() error { return a.pub.Close() }

// amqpAdmin is RabbitMQ: one durable queue per run, named after the run's topic.
type amqpAdmin struct {
	cfg    amqp.Config
	conn   *amqp.ConnectionWrapper
	pub    *amqp.Publisher
	topic  string
	logger watermill.LoggerAdapter
}

func newAMQPAdmin(topic string, logger watermill.LoggerAdapter) (*amqpAdmin, error) {
	cfg := amqpConfig()
	conn, err := amqp.NewConnection(cfg.Connection, logger)
	if err != nil {
		return nil, fmt.Errorf("RabbitMQ is not reachable at %s: %w", redactURL(amqpURL()), err)
	}
	a := &amqpAdmin{cfg: cfg, conn: conn, topic: topic, logger: logger}
	// The default exchange drops messages for a queue that does not exist yet, and the
	// publisher does not declare queues: declare it, with the subscriber's own arguments.
	if err := a.declareQueue(); err != nil {
		_ = conn.Close()
		return nil, err
	}
	a.pub, err = amqp.NewPublisherWithConnection(cfg, logger, conn)
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("AMQP publisher: %w", err)
	}
	return a, nil
}

func (a *amqpAdmin) queueName() string { return a.cfg.Queue.GenerateName(a.topic) }

func (a *amqpAdmin) declareQueue() error {
	ch, err := a.conn.Connection().Channel()
	if err != nil {
		return fmt.Errorf("open AMQP channel: %w", err)
	}
	defer ch.Close()
	err = a.cfg.TopologyBuilder.BuildTopology(ch, amqp.BuildTopologyParams{
		Topic:        a.topic,
		QueueName:    a.queueName(),
		ExchangeName: a.cfg.Exchange.GenerateName(a.topic),
		RoutingKey:   a.cfg.QueueBind.GenerateRoutingKey(a.topic),
	}, a.cfg, a.logger)
	if err != nil {
		return fmt.Errorf("declare queue %s: %w", a.queueName(), err)
	}
	return nil
}

func (a *amqpAdmin) Publish(msgs []*message.Message) error {
	return publishInBatches(a.pub, a.topic, msgs)
}

// Pending returns the queue's ready messages (queue.declare-ok message_count). Deliveries a
// consumer holds unacked are not counted; they return to the queue when its channel closes.
func (a *amqpAdmin) Pending(context.Context) (int64, error) {
	ch, err := a.conn.Connection().Channel()
	if err != nil {
		return 0, fmt.Errorf("open AMQP channel: %w", err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(a.queueName(), true, false, false, false, nil)
	if err != nil {
		return 0, fmt.Errorf("inspect queue %s: %w", a.queueName(), err)
	}
	return int64(q.Messages), nil
}

func (a *amqpAdmin) PendingMeaning() string {
	return "ready messages in queue " + a.queueName()
}

func (a *amqpAdmin) Cleanup(context.Context) error {
	ch, err := a.conn.Connection().Channel()
	if err != nil {
		return fmt.Errorf("open AMQP channel: %w", err)
	}
	defer ch.Close()
	if _, err := ch.QueueDelete(a.queueName(), false, false, false); err != nil {
		return fmt.Errorf("delete queue %s: %w", a.queueName(), err)
	}
	return nil
}

func (a *amqpAdmin) Close() error {
	err := a.pub.Close()
	if cerr := a.conn.Close(); err == nil {
		err = cerr
	}
	return err
}
