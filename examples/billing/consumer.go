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
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"

	inbox "github.com/watermill-inbox/watermill-inbox/middleware"
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
	// Processed, Duplicates, Failed: the inbox's Stats.
	Processed  uint64 `json:"processed"`
	Duplicates uint64 `json:"duplicates"`
	Failed     uint64 `json:"failed"`
	TxRetries  uint64 `json:"tx_retries"`
}

func report(kind string, ib *inbox.Inbox) {
	s := ib.Stats()
	b, _ := json.Marshal(consumerReport{
		PID: os.Getpid(), Processed: s.Processed, Duplicates: s.Duplicates, Failed: s.Failed, TxRetries: s.TxRetries,
	})
	// os.Stdout is unbuffered: the line is in the pipe before the next statement runs.
	fmt.Printf("%s %s\n", kind, b)
}

// runConsumer is the child process: a Watermill router whose handler adds a payment to an
// account balance, wrapped by the inbox. It runs until SIGTERM (graceful: prints STATS) or until
// it SIGKILLs itself (-crash-after) or is SIGKILLed.
func runConsumer(o options) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := consume(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		return 1
	}
	return 0
}

func consume(ctx context.Context, o options) error {
	logger := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))

	// Connections: one per concurrent delivery for the inbox transaction, plus the
	// watermill-sql subscriber's own batch transaction, plus one spare.
	concurrency := 1
	if o.broker == brokerAMQP {
		concurrency = o.amqpConsumers
	}
	pool, err := openPool(ctx, o.schema, o.appName, int32(concurrency+2))
	if err != nil {
		return err
	}
	defer pool.Close()

	store, err := pgstore.New(pool, pgstore.Config{Schema: o.schema})
	if err != nil {
		return err
	}
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: consumerName}, logger)
	if err != nil {
		return err
	}

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	// Order matters: the first middleware added is the outermost. afterCommit sees the inbox's
	// result, i.e. runs after the COMMIT and before the router acks.
	router.AddMiddleware(afterCommit(o.crashAfter, ib), ib.Middleware)

	handler := applyPayment(qualified(o.schema, "accounts"))
	var sub message.Subscriber
	switch o.broker {
	case brokerPostgres:
		// One subscription: watermill-sql hands out one message at a time per consumer group
		// (the group's offset row is locked FOR UPDATE for the whole batch).
		s, err := sqlSubscriber(pool, logger)
		if err != nil {
			return fmt.Errorf("watermill-sql subscriber: %w", err)
		}
		sub = s
		router.AddConsumerHandler("billing", o.topic, sub, handler)
	case brokerAMQP:
		// Each Subscribe opens its own channel with its own prefetch, so amqpConsumers
		// subscriptions process that many deliveries at once.
		s, err := amqp.NewSubscriber(amqpConfig(), logger)
		if err != nil {
			return fmt.Errorf("AMQP subscriber: %w", err)
		}
		sub = s
		for i := range o.amqpConsumers {
			router.AddConsumerHandler(fmt.Sprintf("billing-%d", i), o.topic, sub, handler)
		}
	}

	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(context.Background()) }()
	select {
	case <-router.Running():
		report(lineReady, ib)
	case err := <-runErr:
		return fmt.Errorf("router: %w", err)
	}

	select {
	case <-ctx.Done(): // SIGTERM: graceful stop
	case err := <-runErr:
		return fmt.Errorf("router stopped by itself: %v", err)
	}
	closeErr := router.Close()
	<-runErr
	if err := sub.Close(); err != nil && closeErr == nil {
		closeErr = err
	}
	report(lineStats, ib)
	if closeErr != nil {
		return fmt.Errorf("close: %w", closeErr)
	}
	return nil
}

// applyPayment is the business handler. Its only write runs on the inbox's transaction, so the
// balance change commits or rolls back together with the claim of the message ID.
func applyPayment(accountsTable string) message.NoPublishHandlerFunc {
	update := "UPDATE " + accountsTable + " SET balance = balance + $1 WHERE id = $2"
	return func(msg *message.Message) error {
		var p payment
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return inbox.Permanent(fmt.Errorf("decode payment: %w", err))
		}
		tx, ok := pgstore.TxFromContext(msg.Context())
		if !ok {
			return errors.New("no inbox transaction in the message context: the handler is not wrapped by the inbox")
		}
		tag, err := tx.Exec(msg.Context(), update, p.AmountCents, p.AccountID)
		if err != nil {
			return fmt.Errorf("update balance: %w", err)
		}
		if tag.RowsAffected() != 1 {
			return inbox.Permanent(fmt.Errorf("account %d does not exist", p.AccountID))
		}
		if ran, ok := msg.Context().Value(handlerRanKey{}).(*atomic.Bool); ok {
			ran.Store(true)
		}
		return nil
	}
}

// handlerRanKey carries an *atomic.Bool that applyPayment sets, so afterCommit can tell a
// processed delivery (handler ran, inbox committed) from a skipped duplicate.
type handlerRanKey struct{}

// afterCommit is router-level middleware added before (outside) the inbox. When the inbox
// returns nil after the handler ran, the inbox transaction has committed and the router has not
// acked yet: it acks after this function returns. With crashAfter > 0 it SIGKILLs the process
// right there, after its crashAfter-th processed delivery: committed, never acked.
func afterCommit(crashAfter int, ib *inbox.Inbox) message.HandlerMiddleware {
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
				report(lineCrash, ib)
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {} // SIGKILL cannot be caught; the ack below never happens
			}
			return out, err
		}
	}
}
