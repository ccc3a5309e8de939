//go:build unix

package main

// This file is the billing service as a user would write it: package router builds the
// broker named by the configuration (INBOX_BROKER, INBOX_BROKER_URL, ...), the billing handler
// applies payments behind an inbox and returns a receipt through the outbox, the outbox relay
// publishes the receipts, and a downstream receipts handler counts them behind an inbox of its
// own. What is the demo's and not the service's (the crash points, the reports to the
// orchestrator) is in crash.go.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka"
	"github.com/watermill-inbox/watermill-inbox/adapters/nats"
	"github.com/watermill-inbox/watermill-inbox/adapters/postgres"
	"github.com/watermill-inbox/watermill-inbox/adapters/redis"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/router"
)

const (
	// consumerName is the billing inbox's consumer name and the router's consumer group.
	consumerName = "billing"
	// receiptsConsumerName is the downstream consumer's: its own inbox rows (same table,
	// another consumer name).
	receiptsConsumerName = "receipts"
	// messageType is stored in the inbox's message_type column (metadata "name").
	messageType = "PaymentReceived"
	// receiptType is the message type of the receipts.
	receiptType = "ReceiptIssued"

	// redeliverAfter is how long a delivery held by a killed consumer waits before the broker
	// hands it out again, where the broker waits for a timeout: NATS AckWait, Redis
	// MaxIdleTime, the SQS queue's VisibilityTimeout (production defaults: 30 s and more).
	redeliverAfter = 3 * time.Second
	// concurrency is the deliveries of one topic a consumer processes at once: AMQP consumers,
	// NATS subscriptions, SQS messages in flight. Kafka has one per partition
	// (kafkafake.DefaultPartitions, also 4); PostgreSQL and Redis one at a time.
	concurrency = 4
	// amqpQueueExpiry deletes a run's queue this long after the run's -timeout (see
	// withDemoSettings), in case the run fails before deleting it.
	amqpQueueExpiry = 10 * time.Minute
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

// withDemoSettings sets the adapter settings of the demo on cfg: a delivery that a killed
// consumer held comes back within seconds instead of the production defaults, and several
// deliveries are in flight at once. Everything else is the adapters' defaults. It reads
// o.amqpConsumers and o.timeout, which the orchestrator passes on to its consumers.
func withDemoSettings(cfg router.Config, o options) router.Config {
	// RabbitMQ's x-expires deletes a queue once it had no consumer, no basic.get and no
	// redeclaration for that long (milliseconds). The dead-letter reader's queue is declared at
	// the start and read only at the end, so it must outlive the whole run: a soak runs for
	// more than an hour, and a queue that expired drops the dead letters routed to it.
	expiry := min(o.timeout+amqpQueueExpiry, time.Duration(math.MaxInt32)*time.Millisecond)
	cfg.Settings = map[string]any{}
	cfg.Settings[postgres.Name] = &postgres.Config{PollInterval: 50 * time.Millisecond}
	cfg.Settings[amqp.Name] = &amqp.Config{
		Consumers:              o.amqpConsumers,
		PublishChannelPoolSize: outbox.DefaultMaxInFlight, // the relay keeps this many publishes in flight
		QueueArguments:         map[string]any{"x-expires": int32(expiry.Milliseconds())},
	}
	cfg.Settings[kafka.Name] = &kafka.Config{
		SessionTimeout:    time.Second, // a killed member's partitions move at once
		HeartbeatInterval: 100 * time.Millisecond,
		RebalanceTimeout:  10 * time.Second,
		FetchMaxWait:      50 * time.Millisecond,
		CommitInterval:    100 * time.Millisecond,
		NackResendSleep:   50 * time.Millisecond,
	}
	cfg.Settings[sqs.Name] = &sqs.BrokerConfig{
		// goaws applies the queue's visibility timeout only, not the per-receive one.
		QueueAttributes: map[string]string{"VisibilityTimeout": fmt.Sprint(int(redeliverAfter.Seconds()))},
		WaitTime:        time.Second,
		MaxInFlight:     concurrency,
		CloseTimeout:    2 * time.Second,
	}
	cfg.Settings[nats.Name] = &nats.Config{AckWait: redeliverAfter, MaxAckPending: 4 * concurrency, SubscribersCount: concurrency}
	cfg.Settings[redis.Name] = &redis.Config{NackResendSleep: 50 * time.Millisecond, MaxIdleTime: redeliverAfter, ClaimInterval: 200 * time.Millisecond}
	return cfg
}

// runConsumer is the child process. It runs until SIGTERM (graceful: prints STATS) or until it
// SIGKILLs itself (-crash-after, -crash-on-rejection) or is SIGKILLed.
func runConsumer(o options) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := consume(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		return 1
	}
	return 0
}

// consume runs, in one process and on one router:
//
//   - the billing handler: a payment is added to an account balance and a receipt returned,
//     behind the billing inbox, which dead-letters a payment after MaxAttempts failed attempts
//     and stores the receipt through the outbox in its own transaction;
//   - the outbox relay, which publishes the stored receipts to the receipts topic;
//   - the receipts handler, behind an inbox of its own, which counts each receipt once.
func consume(ctx context.Context, o options) error {
	logger := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))

	cfg, err := router.ConfigFromEnv() // INBOX_BROKER, INBOX_BROKER_URL, INBOX_CONSUMER_GROUP_PREFIX...
	if err != nil {
		return err
	}
	cfg = withDemoSettings(cfg, o)
	cfg.Mode = o.mode // -mode: the inbox mode of the billing consumer (router.AddModeHandler)

	// Connections, per concurrent delivery: the billing inbox transaction, the rejection log's
	// autocommit write and the receipts inbox transaction. Besides: the watermill-sql
	// subscribers' batch transactions, the relay's, the publishers' on PostgreSQL, spares.
	// The database (-db, storage.go): pgstore on a pgx pool, or sqlstore on PostgreSQL or MySQL.
	st, err := openStorage(ctx, o.db, o.schema, o.appName, int32(3*max(concurrency, o.amqpConsumers)+8), false)
	if err != nil {
		return err
	}
	defer st.close()
	store := st.store
	// -shards: the databases of shards 1..N-1; shard 0 is st (shards.go).
	shards, err := openShards(ctx, o, o.schema, o.appName, int32(2*max(concurrency, o.amqpConsumers)+4))
	if err != nil {
		return err
	}
	defer closeAll(shards)

	r, err := router.New(cfg, st.pool, logger) // the pool: the postgres broker's (nil on MySQL)
	if err != nil {
		return fmt.Errorf("%s broker: %w", cfg.Broker, err)
	}
	ob, err := outbox.New(outboxConfig(o.schema), logger)
	if err != nil {
		return err
	}
	metrics, err := newDemoMetrics(o.metricsAddr, st.pg) // Prometheus: see metrics.go
	if err != nil {
		return err
	}
	demoRegistry = metrics
	observer, err := metrics.m.NewObserver(consumerName)
	if err != nil {
		return err
	}
	// r.NewInbox fills in the broker's redelivery signal and broker-side fields.
	billingCfg, err := shardedInbox(inbox.Config{
		ConsumerName: consumerName,
		// Durable attempt counting: a payment whose handler failed MaxAttempts times, in
		// whichever processes, goes to the dead-letter topic, then is acked.
		DeadLetterPublisher: r.Broker.Publisher,
		DeadLetterTopic:     o.deadLetterTopic,
		MaxAttempts:         o.maxAttempts,
		// The receipts the handler returns are written in the inbox transaction.
		Outbox:   ob,
		Observer: observer,
	}, st, shards) // Store, or with -shards a store per database and the route
	if err != nil {
		return err
	}
	billing, err := r.NewInbox(billingCfg, logger)
	if err != nil {
		return err
	}
	receipts, err := r.NewInbox(inbox.Config{Store: store, ConsumerName: receiptsConsumerName}, logger)
	if err != nil {
		return err
	}

	// The demo's crash points: router-level middleware, added before the handlers, so they run
	// outside each handler's inbox (see crash.go).
	crash := newCrashPoints(o, inboxes{billing: billing, receipts: receipts})
	r.AddMiddleware(crash.middleware()...)

	// The receipts the billing handler returns are for the receipts topic. The inbox hands them
	// to the outbox, so the router never publishes them itself.
	handler := billingHandler{
		data:       st.data(),
		accounts:   st.table("accounts"),
		rejections: st.table("rejections"),
		run:        o.run,
		onRejected: crash.onRejected,
	}
	if o.mode == router.ModeStoreThenProcess {
		// The same handler, run by the store-then-process workers (deferred.go).
		if crash.ibs.deferred, err = addDeferredBilling(r, o, st.pg, ob, handler, crash, logger); err != nil {
			return err
		}
	} else {
		r.AddPublishingConsumer(billing, o.topic, o.receiptsTopic, handler.handle)
	}
	r.AddConsumer(receipts, o.receiptsTopic, receiptsHandler(st.data(), st.table("receipts")))

	// The relay reads the outbox with a watermill-sql subscriber and publishes each receipt to
	// its destination topic, at least once: a crash between a publish and the commit of the
	// relay's offset publishes it again, with the same UUID, and the receipts inbox skips it.
	// With -shards, one relay per database: each reads its own database's outbox.
	relays, err := newRelays(append([]*storage{st}, shards...), o.schema, r.Broker.Publisher, logger)
	if err != nil {
		return err
	}

	runErr := make(chan error, 1)
	go func() { runErr <- r.Run(context.Background()) }()
	relayErr := make(chan error, len(relays))
	running := []chan struct{}{r.Running()}
	for _, relay := range relays {
		go func() { relayErr <- relay.Run(context.Background()) }()
		running = append(running, relay.Running())
	}
	for _, running := range running {
		select {
		case <-running:
		case err := <-runErr:
			return fmt.Errorf("router: %w", err)
		case err := <-relayErr:
			return fmt.Errorf("outbox relay: %w", err)
		}
	}
	crash.report(lineReady, consumerReport{})

	select {
	case <-ctx.Done(): // SIGTERM: graceful stop
	case err := <-runErr:
		return fmt.Errorf("router stopped by itself: %v", err)
	case err := <-relayErr:
		return fmt.Errorf("outbox relay stopped by itself: %v", err)
	}
	// The relays first: they publish through the router's broker, which r.Close closes.
	closeErr := errors.Join(closeRelays(relays), r.Close())
	<-runErr
	for range relays {
		<-relayErr
	}
	crash.report(lineStats, consumerReport{})
	if closeErr != nil {
		return fmt.Errorf("close: %w", closeErr)
	}
	return nil
}

// newRelays returns an outbox relay per database in dbs, publishing through pub.
func newRelays(dbs []*storage, schema string, pub message.Publisher, logger watermill.LoggerAdapter) ([]*outbox.Relay, error) {
	var relays []*outbox.Relay
	for _, db := range dbs {
		relay, err := outbox.NewRelay(db.relayConfig(outbox.RelayConfig{
			Config: outboxConfig(schema), Publisher: pub,
			PollInterval: 50 * time.Millisecond,
		}), logger)
		if err != nil {
			return nil, err
		}
		relays = append(relays, relay)
	}
	return relays, nil
}

// closeRelays closes every relay and returns their errors joined.
func closeRelays(relays []*outbox.Relay) error {
	var err error
	for _, relay := range relays {
		err = errors.Join(err, relay.Close())
	}
	return err
}

// outboxConfig is the outbox of a run: watermill-sql's tables "watermill_inbox_outbox" and
// "watermill_offsets_inbox_outbox" in the run's schema (or MySQL database). The Outbox (writer), the Relay
// (reader) and InitializeSchema get the same Config.
func outboxConfig(schema string) outbox.Config {
	return outbox.Config{Schema: schema}
}

// openPool connects to the database at url (INBOX_DATABASE_URL, or a shard's) with search_path set to schema, so watermill-sql's
// unqualified tables live in the run's schema, and with application_name set to appName, so the
// orchestrator can find the consumer's sessions in pg_stat_activity.
func openPool(ctx context.Context, url, schema, appName string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
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
		return nil, fmt.Errorf("PostgreSQL is not reachable at %s: %w", redactURL(url), err)
	}
	return pool, nil
}

// qualified returns the quoted name of a table in schema.
func qualified(schema, table string) string { return pgx.Identifier{schema, table}.Sanitize() }

// billingHandler is the business handler. Its writes run on the inbox's transaction, so the
// balance change and the receipt commit or roll back together with the claim of the message ID.
type billingHandler struct {
	// data is the database (storage.go): the inbox's pgx.Tx or *sql.Tx, and the rejection
	// log's autocommit connection.
	data                 billingData
	accounts, rejections string // quoted, schema-qualified
	run                  int    // this consumer's run number, written to the rejection log
	// onRejected, when set, is called after a poison payment's rejection was logged, with the
	// number of times it has been rejected, in every process (the demo's crash point).
	onRejected func(msg *message.Message, run int64)
	// applied, when set (store-then-process mode), is the table where each applied payment's
	// account and sequence number are recorded, in the handler's transaction, for the
	// ordering check; onApplied is then called after that, the transaction still open (the
	// demo's worker crash point).
	applied   string
	onApplied func(msg *message.Message)
}

func (h billingHandler) handle(msg *message.Message) ([]*message.Message, error) {
	var p payment
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return nil, inbox.Permanent(fmt.Errorf("decode payment: %w", err))
	}
	ctx := msg.Context()
	tx, ok := h.data.tx(ctx) // pgstore.TxFromContext or sqlstore.TxFromContext
	if !ok {
		return nil, errors.New("no inbox transaction in the message context: the handler is not wrapped by the inbox")
	}
	changed, err := tx.exec(ctx, "UPDATE "+h.accounts+" SET balance = balance + $1 WHERE id = $2 AND NOT frozen", p.AmountCents, p.AccountID)
	if err != nil {
		return nil, fmt.Errorf("update balance: %w", err)
	}
	if changed != 1 {
		return nil, h.reject(msg, tx, p)
	}
	if h.applied != "" {
		seq, err := strconv.ParseInt(msg.Metadata.Get(sequenceField), 10, 64)
		if err != nil {
			return nil, inbox.Permanent(fmt.Errorf("payment sequence: %w", err))
		}
		if _, err := tx.exec(ctx, "INSERT INTO "+h.applied+" (account_id, seq, message_id) VALUES ($1, $2, $3)",
			p.AccountID, seq, msg.UUID); err != nil {
			return nil, fmt.Errorf("record the payment's sequence: %w", err)
		}
		if h.onApplied != nil {
			h.onApplied(msg)
		}
	}
	markHandlerRan(msg)
	body, err := json.Marshal(receipt{PaymentID: msg.UUID, AccountID: p.AccountID, AmountCents: p.AmountCents})
	if err != nil {
		return nil, err
	}
	r := message.NewMessage(watermill.NewUUID(), body)
	r.Metadata.Set(inbox.DefaultMessageTypeKey, receiptType)
	return []*message.Message{r}, nil
}

// reject explains a payment the UPDATE did not apply. A frozen account is an ordinary error:
// the payment may go through once the account is unfrozen, so the broker redelivers it, and the
// inbox dead-letters it after MaxAttempts. An unknown account is a permanent error: dead-lettered
// at once.
func (h billingHandler) reject(msg *message.Message, tx dataTx, p payment) error {
	ctx := msg.Context()
	var frozen bool
	err := tx.queryRow(ctx, "SELECT frozen FROM "+h.accounts+" WHERE id = $1", p.AccountID).Scan(&frozen)
	switch {
	case isNoRows(err):
		return inbox.Permanent(fmt.Errorf("account %d does not exist", p.AccountID))
	case err != nil:
		return fmt.Errorf("read account: %w", err)
	case !frozen:
		return fmt.Errorf("account %d: payment not applied", p.AccountID)
	}
	// The rejection log is written outside the inbox transaction, on an autocommit connection
	// of the pool, so every handler run leaves its row although its transaction rolls back.
	run, err := h.data.logRejection(ctx, h.rejections, msg.UUID, h.run)
	if err != nil {
		return fmt.Errorf("log rejection: %w", err)
	}
	if h.onRejected != nil {
		h.onRejected(msg, run)
	}
	return fmt.Errorf("account %d is frozen", p.AccountID)
}

// receiptsHandler is the downstream consumer's handler: it counts a receipt by inserting a row,
// on its inbox's transaction. The table has no unique key on purpose: a receipt counted twice
// would show as two rows.
func receiptsHandler(data billingData, receiptsTable string) message.NoPublishHandlerFunc {
	insert := "INSERT INTO " + receiptsTable + " (receipt_id, payment_id, account_id, amount_cents) VALUES ($1, $2, $3, $4)"
	return func(msg *message.Message) error {
		var r receipt
		if err := json.Unmarshal(msg.Payload, &r); err != nil {
			return inbox.Permanent(fmt.Errorf("decode receipt: %w", err))
		}
		tx, ok := data.tx(msg.Context())
		if !ok {
			return errors.New("no inbox transaction in the message context")
		}
		if _, err := tx.exec(msg.Context(), insert, msg.UUID, r.PaymentID, r.AccountID, r.AmountCents); err != nil {
			return fmt.Errorf("count receipt: %w", err)
		}
		return nil
	}
}
