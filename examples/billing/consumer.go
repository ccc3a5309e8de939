//go:build unix

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// Lines the consumer writes to stdout for the orchestrator, followed by a JSON object.
const (
	// lineReady: the router is running.
	lineReady = "READY"
	// lineCrash: the inbox Stats just before the consumer SIGKILLs itself.
	lineCrash = "CRASH"
	// lineStats: the inbox Stats after a graceful stop.
	lineStats = "STATS"
)

// consumerReport is the JSON of the consumer's stdout lines.
type consumerReport struct {
	PID int `json:"pid"`
	// Processed ... DeadLetteredSkips: the billing inbox's Stats.
	Processed         uint64 `json:"processed"`
	Duplicates        uint64 `json:"duplicates"`
	Failed            uint64 `json:"failed"`
	TxRetries         uint64 `json:"tx_retries"`
	DeadLettered      uint64 `json:"dead_lettered"`
	DeadLetteredSkips uint64 `json:"dead_lettered_skips"`
	// ReceiptsProcessed, ReceiptsDuplicates: the receipts inbox's Stats.
	ReceiptsProcessed  uint64 `json:"receipts_processed"`
	ReceiptsDuplicates uint64 `json:"receipts_duplicates"`
	// Rejected and RejectedRun: the poison payment (and its handler run, across processes) in
	// whose handler the consumer SIGKILLed itself (-crash-on-rejection).
	Rejected    string `json:"rejected,omitempty"`
	RejectedRun int64  `json:"rejected_run,omitempty"`
}

// inboxes are the consumer's two inboxes: the billing handler's and the downstream receipts
// handler's.
type inboxes struct{ billing, receipts *inbox.Inbox }

func (ibs inboxes) report(kind string, r consumerReport) {
	b, r2 := ibs.billing.Stats(), ibs.receipts.Stats()
	r.PID = os.Getpid()
	r.Processed, r.Duplicates, r.Failed, r.TxRetries = b.Processed, b.Duplicates, b.Failed, b.TxRetries
	r.DeadLettered, r.DeadLetteredSkips = b.DeadLettered, b.DeadLetteredSkips
	r.ReceiptsProcessed, r.ReceiptsDuplicates = r2.Processed, r2.Duplicates
	j, _ := json.Marshal(r)
	// os.Stdout is unbuffered: the line is in the pipe before the next statement runs.
	fmt.Printf("%s %s\n", kind, j)
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

// consume runs, in one process:
//
//   - the billing handler: a payment is added to an account balance and a receipt returned,
//     behind the billing inbox, which dead-letters a payment after MaxAttempts failed attempts
//     and stores the receipt through the outbox in its own transaction;
//   - the outbox relay, which publishes the stored receipts to the receipts topic;
//   - the receipts handler, behind an inbox of its own, which counts each receipt once.
func consume(ctx context.Context, o options) error {
	logger := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))

	// Connections, per concurrent delivery: the billing inbox transaction, the rejection log's
	// autocommit write and the receipts inbox transaction. Besides: the two watermill-sql
	// subscribers' batch transactions, the relay's, the two publishers' on PostgreSQL, spares.
	concurrency := 1
	switch {
	case o.broker == brokerAMQP:
		concurrency = o.amqpConsumers
	case isAdapterBroker(o.broker):
		concurrency = adapterConcurrency
	}
	pool, err := openPool(ctx, o.schema, o.appName, int32(3*concurrency+8))
	if err != nil {
		return err
	}
	defer pool.Close()

	b, err := newConsumerBroker(o, pool, logger)
	if err != nil {
		return err
	}
	defer b.Close()

	store, err := pgstore.New(pool, pgstore.Config{Schema: o.schema})
	if err != nil {
		return err
	}
	ob, err := outbox.New(outboxConfig(o.schema), logger)
	if err != nil {
		return err
	}
	billing, err := inbox.New(inbox.Config{
		Store:        store,
		ConsumerName: consumerName,
		// Durable attempt counting: a payment whose handler failed MaxAttempts times, in
		// whichever processes, goes to the dead-letter topic, then is acked.
		DeadLetterPublisher: b.pub,
		DeadLetterTopic:     o.deadLetterTopic,
		MaxAttempts:         o.maxAttempts,
		// The receipts the handler returns are written in the inbox transaction.
		Outbox: ob,
	}, logger)
	if err != nil {
		return err
	}
	receipts, err := inbox.New(inbox.Config{Store: store, ConsumerName: receiptsConsumerName}, logger)
	if err != nil {
		return err
	}
	ibs := inboxes{billing: billing, receipts: receipts}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	gate := new(crashGate)
	var onRejected func(*message.Message, int64)
	if o.crashOnRejection > 0 {
		onRejected = func(msg *message.Message, run int64) {
			if run == int64(o.crashOnRejection) {
				gate.crashAlone(msg, func() { ibs.report(lineCrash, consumerReport{Rejected: msg.UUID, RejectedRun: run}) })
			}
		}
	}
	applyPayment := billingHandler{
		pool:       pool,
		accounts:   qualified(o.schema, "accounts"),
		rejections: qualified(o.schema, "rejections"),
		run:        o.run,
		onRejected: onRejected,
	}.handle
	countReceipt := receiptsHandler(qualified(o.schema, "receipts"))

	committed := afterCommit(o.crashAfter, gate, ibs) // one counter for all billing handlers
	for i, sub := range b.paymentSubs {
		// AddHandler with a publish topic: the receipts the handler returns are for the
		// receipts topic. The inbox hands them to the outbox, so the router's publisher is
		// never called.
		h := router.AddHandler(fmt.Sprintf("billing-%d", i), o.topic, sub, o.receiptsTopic, routerNeverPublishes{}, applyPayment)
		// Order matters: the first middleware added is the outermost. The gate holds the
		// consumer's own crashes back until the other deliveries left the inbox (see
		// crashGate); afterCommit sees the inbox's result, i.e. runs after the COMMIT and before
		// the router acks; the inbox is innermost, so the handler runs on its transaction.
		h.AddMiddleware(gate.Middleware, committed, billing.Middleware)
	}
	for i, sub := range b.receiptSubs {
		h := router.AddConsumerHandler(fmt.Sprintf("receipts-%d", i), o.receiptsTopic, sub, countReceipt)
		h.AddMiddleware(receipts.Middleware)
	}

	// The relay reads the outbox with a watermill-sql subscriber and publishes each receipt to
	// its destination topic, at least once: a crash between a publish and the commit of the
	// relay's offset publishes it again, with the same UUID, and the receipts inbox skips it.
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		Config: outboxConfig(o.schema), Pool: pool, Publisher: b.pub,
		PollInterval: 50 * time.Millisecond,
	}, logger)
	if err != nil {
		return err
	}

	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(context.Background()) }()
	relayErr := make(chan error, 1)
	go func() { relayErr <- relay.Run(context.Background()) }()
	for _, running := range []chan struct{}{router.Running(), relay.Running()} {
		select {
		case <-running:
		case err := <-runErr:
			return fmt.Errorf("router: %w", err)
		case err := <-relayErr:
			return fmt.Errorf("outbox relay: %w", err)
		}
	}
	ibs.report(lineReady, consumerReport{})

	select {
	case <-ctx.Done(): // SIGTERM: graceful stop
	case err := <-runErr:
		return fmt.Errorf("router stopped by itself: %v", err)
	case err := <-relayErr:
		return fmt.Errorf("outbox relay stopped by itself: %v", err)
	}
	closeErr := errors.Join(router.Close(), relay.Close())
	<-runErr
	<-relayErr
	ibs.report(lineStats, consumerReport{})
	if closeErr != nil {
		return fmt.Errorf("close: %w", closeErr)
	}
	return nil
}

// consumerBroker holds the consumer's subscriptions and its publisher on the run's broker.
type consumerBroker struct {
	// paymentSubs and receiptSubs: one subscriber per concurrent handler of each topic.
	paymentSubs, receiptSubs []message.Subscriber
	// pub publishes the dead letters (inbox) and the receipts (relay).
	pub    message.Publisher
	closes []func() error
}

func newConsumerBroker(o options, pool *pgxpool.Pool, logger watermill.LoggerAdapter) (*consumerBroker, error) {
	b := &consumerBroker{}
	switch o.broker {
	case brokerPostgres:
		// One subscription per topic: watermill-sql hands out one message at a time per
		// consumer group (the group's offset row is locked FOR UPDATE for the whole batch).
		payments, err := sqlSubscriber(pool, consumerName, logger)
		if err != nil {
			return nil, fmt.Errorf("watermill-sql subscriber: %w", err)
		}
		b.closes = append(b.closes, payments.Close)
		receipts, err := sqlSubscriber(pool, receiptsConsumerName, logger)
		if err != nil {
			b.Close()
			return nil, fmt.Errorf("watermill-sql subscriber: %w", err)
		}
		b.closes = append(b.closes, receipts.Close)
		pub, err := sqlPublisher(pool, logger)
		if err != nil {
			b.Close()
			return nil, fmt.Errorf("watermill-sql publisher: %w", err)
		}
		b.closes = append(b.closes, pub.Close)
		b.paymentSubs, b.receiptSubs, b.pub = []message.Subscriber{payments}, []message.Subscriber{receipts}, pub
	case brokerAMQP:
		// Each Subscribe opens its own channel with its own prefetch, so amqpConsumers
		// handlers of one subscriber process that many deliveries at once.
		sub, err := amqp.NewSubscriber(amqpConfig(), logger)
		if err != nil {
			return nil, fmt.Errorf("AMQP subscriber: %w", err)
		}
		b.closes = append(b.closes, sub.Close)
		// The orchestrator declared the dead-letter and receipts queues: the publisher does
		// not, and RabbitMQ drops what is published to a missing queue.
		pub, err := amqp.NewPublisher(amqpConfig(), logger)
		if err != nil {
			b.Close()
			return nil, fmt.Errorf("AMQP publisher: %w", err)
		}
		b.closes = append(b.closes, pub.Close)
		for range o.amqpConsumers {
			b.paymentSubs = append(b.paymentSubs, sub)
			b.receiptSubs = append(b.receiptSubs, sub)
		}
		b.pub = pub
	default:
		// Kafka, SQS, NATS, Redis: the adapter packages, one broker per consumer group. The
		// subscription handles deliveries concurrently (Kafka: one per partition; NATS:
		// SubscribersCount; SQS: MaxInFlight; Redis: one at a time).
		payments, err := newAdapterBroker(o.broker, consumerName, logger)
		if err != nil {
			return nil, fmt.Errorf("%s broker: %w", o.broker, err)
		}
		b.closes = append(b.closes, payments.Close)
		receipts, err := newAdapterBroker(o.broker, receiptsConsumerName, logger)
		if err != nil {
			b.Close()
			return nil, fmt.Errorf("%s broker: %w", o.broker, err)
		}
		b.closes = append(b.closes, receipts.Close)
		b.paymentSubs, b.receiptSubs, b.pub = []message.Subscriber{payments.Subscriber}, []message.Subscriber{receipts.Subscriber}, payments.Publisher
	}
	return b, nil
}

// Close closes the subscribers, then the publisher. Call it after the router and the relay
// stopped.
func (b *consumerBroker) Close() {
	for _, c := range b.closes {
		_ = c()
	}
}

// routerNeverPublishes is the router's publisher of the billing handler. With Config.Outbox set
// the inbox stores the handler's messages and returns none, so the router never publishes.
type routerNeverPublishes struct{}

func (routerNeverPublishes) Publish(string, ...*message.Message) error {
	return errors.New("the router must not publish: the receipts go through the outbox")
}

func (routerNeverPublishes) Close() error { return nil }

// billingHandler is the business handler. Its writes run on the inbox's transaction, so the
// balance change and the receipt commit or roll back together with the claim of the message ID.
type billingHandler struct {
	pool                 *pgxpool.Pool
	accounts, rejections string // quoted, schema-qualified
	run                  int    // this consumer's run number, written to the rejection log
	// onRejected, when set, is called after a poison payment's rejection was logged, with the
	// number of times it has been rejected, in every process (the demo's crash point).
	onRejected func(msg *message.Message, run int64)
}

func (h billingHandler) handle(msg *message.Message) ([]*message.Message, error) {
	var p payment
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return nil, inbox.Permanent(fmt.Errorf("decode payment: %w", err))
	}
	ctx := msg.Context()
	tx, ok := pgstore.TxFromContext(ctx)
	if !ok {
		return nil, errors.New("no inbox transaction in the message context: the handler is not wrapped by the inbox")
	}
	tag, err := tx.Exec(ctx, "UPDATE "+h.accounts+" SET balance = balance + $1 WHERE id = $2 AND NOT frozen", p.AmountCents, p.AccountID)
	if err != nil {
		return nil, fmt.Errorf("update balance: %w", err)
	}
	if tag.RowsAffected() != 1 {
		return nil, h.reject(msg, tx, p)
	}
	if ran, ok := ctx.Value(handlerRanKey{}).(*atomic.Bool); ok {
		ran.Store(true)
	}
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
func (h billingHandler) reject(msg *message.Message, tx pgx.Tx, p payment) error {
	ctx := msg.Context()
	var frozen bool
	err := tx.QueryRow(ctx, "SELECT frozen FROM "+h.accounts+" WHERE id = $1", p.AccountID).Scan(&frozen)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return inbox.Permanent(fmt.Errorf("account %d does not exist", p.AccountID))
	case err != nil:
		return fmt.Errorf("read account: %w", err)
	case !frozen:
		return fmt.Errorf("account %d: payment not applied", p.AccountID)
	}
	// The rejection log is written outside the inbox transaction, on an autocommit connection
	// of the pool, so every handler run leaves its row although its transaction rolls back.
	var run int64
	err = h.pool.QueryRow(ctx, "WITH logged AS (INSERT INTO "+h.rejections+" (message_id, consumer_run) VALUES ($1, $2)) "+
		"SELECT count(*) + 1 FROM "+h.rejections+" WHERE message_id = $1", msg.UUID, h.run).Scan(&run)
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
func receiptsHandler(receiptsTable string) message.NoPublishHandlerFunc {
	insert := "INSERT INTO " + receiptsTable + " (receipt_id, payment_id, account_id, amount_cents) VALUES ($1, $2, $3, $4)"
	return func(msg *message.Message) error {
		var r receipt
		if err := json.Unmarshal(msg.Payload, &r); err != nil {
			return inbox.Permanent(fmt.Errorf("decode receipt: %w", err))
		}
		tx, ok := pgstore.TxFromContext(msg.Context())
		if !ok {
			return errors.New("no inbox transaction in the message context")
		}
		if _, err := tx.Exec(msg.Context(), insert, msg.UUID, r.PaymentID, r.AccountID, r.AmountCents); err != nil {
			return fmt.Errorf("count receipt: %w", err)
		}
		return nil
	}
}

// handlerRanKey carries an *atomic.Bool that the billing handler sets, so afterCommit can tell
// a processed delivery (handler ran, inbox committed) from a skipped duplicate.
type handlerRanKey struct{}

// afterCommit is handler middleware added before (outside) the inbox. When the inbox returns
// nil after the handler ran, the inbox transaction has committed and the router has not acked
// yet: it acks after this function returns. With crashAfter > 0 it SIGKILLs the process right
// there, after its crashAfter-th processed delivery: committed, never acked.
func afterCommit(crashAfter int, gate *crashGate, ibs inboxes) message.HandlerMiddleware {
	var processed atomic.Int64
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ran := new(atomic.Bool)
			msg.SetContext(context.WithValue(msg.Context(), handlerRanKey{}, ran))
			out, err := h(msg)
			if err != nil || !ran.Load() {
				return out, err
			}
			if n := processed.Add(1); crashAfter > 0 && n == int64(crashAfter) {
				// SIGKILL cannot be caught: the ack after this return never happens.
				gate.crashAlone(msg, func() { ibs.report(lineCrash, consumerReport{}) })
			}
			return out, err
		}
	}
}

// crashGate is the outermost billing middleware. It lets the consumer's own crashes (crashAlone:
// after the K-th commit, and inside a poison payment's handler) wait until every other billing
// delivery has left the inbox, and makes new ones wait before entering it.
//
// A real crash lands anywhere, and costs every delivery it interrupts inside the inbox one
// counted attempt. That is what the design promises, and the orchestrator's mid-stream kill
// shows it; but it would blur the exact numbers the demo checks for poison payments: a crash
// between the inbox's attempt count and the handler costs an attempt without a handler run (the
// message is dead-lettered after one run fewer), and a crash between publishing a dead letter
// and recording it publishes the dead letter again (dead letters are at least once). So the
// consumer's own crashes interrupt nothing but the delivery they happen in, and "MaxAttempts
// handler runs, one dead letter" is checked exactly; and a payment loses at most two attempts to
// crashes (its delivery and its re-sent duplicate, both inside the inbox at the mid-stream
// kill), so MaxAttempts 3 still applies it.
type crashGate struct {
	mu      sync.RWMutex
	crashed atomic.Bool
}

type gateLeaveKey struct{}

func (g *crashGate) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		g.mu.RLock()
		leave := sync.OnceFunc(g.mu.RUnlock)
		defer leave()
		msg.SetContext(context.WithValue(msg.Context(), gateLeaveKey{}, leave))
		return h(msg)
	}
}

// crashAlone SIGKILLs the process, inside the delivery of msg, once no other delivery is in
// the inbox; report runs just before. Only the first call crashes; later calls return at once.
func (g *crashGate) crashAlone(msg *message.Message, report func()) {
	if !g.crashed.CompareAndSwap(false, true) {
		return
	}
	if leave, ok := msg.Context().Value(gateLeaveKey{}).(func()); ok {
		leave() // this delivery stays in its transaction, but must not wait for itself
	}
	g.mu.Lock()
	report()
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}
