//go:build unix

package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
)

const (
	// consumerName is the billing inbox's consumer name and the watermill-sql consumer group.
	consumerName = "billing"
	// receiptsConsumerName is the downstream consumer's: its own inbox rows (same table, another
	// consumer name) and its own watermill-sql consumer group.
	receiptsConsumerName = "receipts"
	// messageType is stored in the inbox's message_type column (metadata "name").
	messageType = "PaymentReceived"
	// receiptType is the message type of the receipts.
	receiptType = "ReceiptIssued"
	// amqpPrefetch is the QoS prefetch of each AMQP subscription: deliveries the broker hands
	// out before they are acked, so several are in flight (unacked) at any moment.
	amqpPrefetch = 16
	// amqpPublishChannels is the size of each AMQP publisher's channel pool: concurrent
	// Publish calls (the relay's and the dead letters of amqpConsumers handlers).
	amqpPublishChannels = 4
	// amqpQueueExpiry deletes a run's queue this long after its last consumer left, in case the
	// run fails before deleting it (RabbitMQ's x-expires, in milliseconds).
	amqpQueueExpiry = int32(10 * 60 * 1000)
)

// payment is the message payload: a producer-side payment of amountCents into an account.
type payment struct {
	AccountID   int64 `json:"account_id"`
	AmountCents int64 `json:"amount_cents"`
}

// receipt is the payload of the message the billing handler returns for each payment it
// applied. The outbox stores it in the inbox transaction; the relay publishes it afterwards.
type receipt struct {
	PaymentID   string `json:"payment_id"`
	AccountID   int64  `json:"account_id"`
	AmountCents int64  `json:"amount_cents"`
}

// topics are the broker topics of one run, all on the same broker.
type topics struct {
	// payments is consumed by the billing handler.
	payments string
	// deadLetters receives the poison payments, from the billing inbox.
	deadLetters string
	// receipts receives the receipts, from the outbox relay; the receipts handler consumes it.
	receipts string
}

// runTopics names the topics. watermill-sql's DefaultPostgreSQLSchema stores topic "payments"
// in the unqualified table "watermill_payments" (offsets in "watermill_offsets_payments"), which
// the pools' search_path places in the run's own schema. RabbitMQ queues are global, so they
// carry the run's ID, and so do Kafka topics, SQS queues, NATS streams and Redis stream keys.
func runTopics(broker, runID string) topics {
	prefix := ""
	if broker != brokerPostgres {
		prefix = "billing_demo_" + runID + "_"
	}
	return topics{payments: prefix + "payments", deadLetters: prefix + "payments_dead_letters", receipts: prefix + "receipts"}
}

// outboxConfig is the outbox of a run: watermill-sql's tables "watermill_inbox_outbox" and
// "watermill_offsets_inbox_outbox" in the run's schema. The Outbox (writer), the Relay
// (reader) and InitializeSchema get the same Config.
func outboxConfig(schema string) outbox.Config {
	return outbox.Config{Schema: schema}
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

// sqlSubscriber is a watermill-sql subscriber of the consumer. It reads up to 100 messages per
// batch inside one REPEATABLE READ transaction on its own connection and commits the consumer
// group's offset only after the whole batch was acked: a crash redelivers the batch. A nacked
// message is handed out again after ResendInterval, before any later one.
func sqlSubscriber(pool *pgxpool.Pool, consumerGroup string, logger watermill.LoggerAdapter) (*sql.Subscriber, error) {
	return sql.NewSubscriber(sql.BeginnerFromPgx(pool), sql.SubscriberConfig{
		ConsumerGroup:    consumerGroup,
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
// call returns after the broker committed the batch) on a pool of channels (the default opens
// and closes a channel per Publish call, which triples the cost of the relay's one-message
// publishes) and an expiry for abandoned queues.
func amqpConfig() amqp.Config {
	cfg := amqp.NewDurableQueueConfig(amqpURL())
	cfg.Queue.Arguments = map[string]any{"x-expires": amqpQueueExpiry}
	cfg.Consume.Qos.PrefetchCount = amqpPrefetch
	cfg.Publish.Transactional = true
	cfg.Publish.ChannelPoolSize = amqpPublishChannels
	return cfg
}

// brokerAdmin is what the orchestrator needs from a broker: publish, see what is left, read the
// dead letters, clean up.
type brokerAdmin interface {
	// Publish sends msgs to the run's payments topic, in order, in batches.
	Publish(msgs []*message.Message) error
	// Pending returns how many payment deliveries the broker still holds for the consumer.
	Pending(ctx context.Context) (int64, error)
	// PendingMeaning says what Pending counts, for the summary.
	PendingMeaning() string
	// DeadLetters reads every message on the dead-letter topic (for RabbitMQ and SQS: takes them off
	// the queue; for the brokers of newAdapterBroker: consumes them in a group of their own
	// until want arrived and no more came for a second).
	DeadLetters(ctx context.Context, want int) ([]deadLetter, error)
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

// deadLetter is a message read from the dead-letter topic.
type deadLetter struct {
	UUID string
	// Attempts is the inbox's inbox_attempts metadata: the attempts counted for the message.
	Attempts string
}

// sqlAdmin is the watermill-sql broker: the messages and offsets tables in the run's schema.
type sqlAdmin struct {
	pool   *pgxpool.Pool
	pub    *sql.Publisher
	schema string
	topics topics
}

// newSQLAdmin creates the topics' tables, so the consumers' publishers and subscribers find
// them and the orchestrator can read the dead-letter topic even when it is empty. The schema
// must exist.
func newSQLAdmin(pool *pgxpool.Pool, schema string, t topics, logger watermill.LoggerAdapter) (*sqlAdmin, error) {
	pub, err := sqlPublisher(pool, logger)
	if err != nil {
		return nil, fmt.Errorf("watermill-sql publisher: %w", err)
	}
	sub, err := sqlSubscriber(pool, consumerName, logger)
	if err != nil {
		return nil, fmt.Errorf("watermill-sql subscriber: %w", err)
	}
	defer sub.Close()
	for _, topic := range []string{t.payments, t.deadLetters, t.receipts} {
		if err := sub.SubscribeInitialize(topic); err != nil {
			_ = pub.Close()
			return nil, fmt.Errorf("create the tables of topic %s: %w", topic, err)
		}
	}
	return &sqlAdmin{pool: pool, pub: pub, schema: schema, topics: t}, nil
}

func (a *sqlAdmin) Publish(msgs []*message.Message) error {
	return publishInBatches(a.pub, a.topics.payments, msgs)
}

// Pending counts the rows after the consumer group's committed offset. The subscriber commits
// its offset at the end of each batch, so this is also what a crash would redeliver.
func (a *sqlAdmin) Pending(ctx context.Context) (int64, error) {
	msgs := qualified(a.schema, "watermill_"+a.topics.payments)
	offsets := qualified(a.schema, "watermill_offsets_"+a.topics.payments)
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

// DeadLetters reads the dead-letter topic's table.
func (a *sqlAdmin) DeadLetters(ctx context.Context, _ int) ([]deadLetter, error) {
	rows, err := a.pool.Query(ctx, "SELECT uuid, coalesce(metadata->>$1, '') FROM "+
		qualified(a.schema, "watermill_"+a.topics.deadLetters)+` ORDER BY "offset"`, inbox.DeadLetterAttemptsKey)
	if err != nil {
		return nil, fmt.Errorf("read the dead-letter topic: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[deadLetter])
}

func (a *sqlAdmin) Cleanup(context.Context) error { return nil } // the tables go with the schema

func (a *sqlAdmin) Close() error { return a.pub.Close() }

// amqpAdmin is RabbitMQ: three durable queues per run (payments, dead letters, receipts), named
// after the run's topics.
type amqpAdmin struct {
	cfg    amqp.Config
	conn   *amqp.ConnectionWrapper
	pub    *amqp.Publisher
	topics topics
	logger watermill.LoggerAdapter
}

func newAMQPAdmin(t topics, logger watermill.LoggerAdapter) (*amqpAdmin, error) {
	cfg := amqpConfig()
	conn, err := amqp.NewConnection(cfg.Connection, logger)
	if err != nil {
		return nil, fmt.Errorf("RabbitMQ is not reachable at %s: %w", redactURL(amqpURL()), err)
	}
	a := &amqpAdmin{cfg: cfg, conn: conn, topics: t, logger: logger}
	// The default exchange drops messages for a queue that does not exist yet, and the
	// publishers do not declare queues: declare all three before anything is published, with
	// the subscribers' own arguments. A dead letter or a receipt published to a missing queue
	// would be lost without an error, and the inbox or the relay would ack its source.
	for _, topic := range a.allTopics() {
		if err := a.declareQueue(topic); err != nil {
			_ = conn.Close()
			return nil, err
		}
	}
	a.pub, err = amqp.NewPublisherWithConnection(cfg, logger, conn)
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("AMQP publisher: %w", err)
	}
	return a, nil
}

func (a *amqpAdmin) allTopics() []string {
	return []string{a.topics.payments, a.topics.deadLetters, a.topics.receipts}
}

func (a *amqpAdmin) queueName(topic string) string { return a.cfg.Queue.GenerateName(topic) }

func (a *amqpAdmin) declareQueue(topic string) error {
	ch, err := a.conn.Connection().Channel()
	if err != nil {
		return fmt.Errorf("open AMQP channel: %w", err)
	}
	defer ch.Close()
	err = a.cfg.TopologyBuilder.BuildTopology(ch, amqp.BuildTopologyParams{
		Topic:        topic,
		QueueName:    a.queueName(topic),
		ExchangeName: a.cfg.Exchange.GenerateName(topic),
		RoutingKey:   a.cfg.QueueBind.GenerateRoutingKey(topic),
	}, a.cfg, a.logger)
	if err != nil {
		return fmt.Errorf("declare queue %s: %w", a.queueName(topic), err)
	}
	return nil
}

func (a *amqpAdmin) Publish(msgs []*message.Message) error {
	return publishInBatches(a.pub, a.topics.payments, msgs)
}

// Pending returns the queue's ready messages (queue.declare-ok message_count). Deliveries a
// consumer holds unacked are not counted; they return to the queue when its channel closes.
func (a *amqpAdmin) Pending(context.Context) (int64, error) {
	ch, err := a.conn.Connection().Channel()
	if err != nil {
		return 0, fmt.Errorf("open AMQP channel: %w", err)
	}
	defer ch.Close()
	queue := a.queueName(a.topics.payments)
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return 0, fmt.Errorf("inspect queue %s: %w", queue, err)
	}
	return int64(q.Messages), nil
}

func (a *amqpAdmin) PendingMeaning() string {
	return "ready messages in queue " + a.queueName(a.topics.payments)
}

// DeadLetters takes every message off the dead-letter queue (basic.get, then ack), decoded by
// watermill-amqp's marshaler. The consumers are stopped, so none is unacked elsewhere.
func (a *amqpAdmin) DeadLetters(ctx context.Context, _ int) ([]deadLetter, error) {
	ch, err := a.conn.Connection().Channel()
	if err != nil {
		return nil, fmt.Errorf("open AMQP channel: %w", err)
	}
	defer ch.Close()
	queue := a.queueName(a.topics.deadLetters)
	var dls []deadLetter
	for ctx.Err() == nil {
		d, ok, err := ch.Get(queue, false)
		if err != nil {
			return nil, fmt.Errorf("read queue %s: %w", queue, err)
		}
		if !ok {
			return dls, nil
		}
		msg, err := a.cfg.Marshaler.Unmarshal(d)
		if err != nil {
			return nil, fmt.Errorf("decode a message of queue %s: %w", queue, err)
		}
		if err := d.Ack(false); err != nil {
			return nil, fmt.Errorf("ack a message of queue %s: %w", queue, err)
		}
		dls = append(dls, deadLetter{UUID: msg.UUID, Attempts: msg.Metadata.Get(inbox.DeadLetterAttemptsKey)})
	}
	return nil, ctx.Err()
}

func (a *amqpAdmin) Cleanup(context.Context) error {
	var errs []error
	for _, topic := range a.allTopics() {
		if err := a.deleteQueue(a.queueName(topic)); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// deleteQueue deletes a queue on a channel of its own: a failed operation closes the channel.
func (a *amqpAdmin) deleteQueue(queue string) error {
	ch, err := a.conn.Connection().Channel()
	if err != nil {
		return fmt.Errorf("open AMQP channel: %w", err)
	}
	defer ch.Close()
	if _, err := ch.QueueDelete(queue, false, false, false); err != nil {
		return fmt.Errorf("delete queue %s: %w", queue, err)
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
