package inboxtest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// DeliverOptions adjust how Deliver and DeliverConcurrently hand a message to a handler.
type DeliverOptions struct {
	// PublishTopic names the handler's publish topic (inbox.ContextWithPublishTopic), so a
	// handler that returns messages stores them in its inbox's Outbox as it would under
	// Watermill's router.AddHandler. Empty: none.
	PublishTopic string
	// Timeout bounds each delivery's context. Default: 30 seconds.
	Timeout time.Duration
}

func (o DeliverOptions) context() (context.Context, context.CancelFunc) {
	timeout := o.Timeout
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	if o.PublishTopic != "" {
		ctx = inbox.ContextWithPublishTopic(ctx, o.PublishTopic)
	}
	return ctx, cancel
}

// Deliver hands h (an inbox-wrapped handler, ib.Middleware(yourHandler)) a copy of msg n times
// in a row, as an at-least-once broker redelivering it would, each with a fresh context, and
// returns each delivery's error (nil: the router would ack).
func Deliver(h message.HandlerFunc, msg *message.Message, n int, opts DeliverOptions) []error {
	errs := make([]error, n)
	for i := range n {
		ctx, cancel := opts.context()
		m := msg.Copy()
		m.SetContext(ctx)
		_, errs[i] = h(m)
		cancel()
	}
	return errs
}

// DeliverConcurrently hands h n copies of msg at the same moment (released together once all
// n goroutines are ready), as a broker delivering duplicates to competing consumers would, and
// returns each delivery's error.
func DeliverConcurrently(h message.HandlerFunc, msg *message.Message, n int, opts DeliverOptions) []error {
	errs := make([]error, n)
	var ready, done sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		ready.Add(1)
		done.Add(1)
		go func() {
			defer done.Done()
			ctx, cancel := opts.context()
			defer cancel()
			m := msg.Copy()
			m.SetContext(ctx)
			ready.Done()
			<-start
			_, errs[i] = h(m)
		}()
	}
	ready.Wait()
	close(start)
	done.Wait()
	return errs
}

// WaitProcessed waits until ib has processed at least n deliveries (Stats().Processed), for a
// consumer running under a router, and fails t after timeout.
func WaitProcessed(t testing.TB, ib *inbox.Inbox, n uint64, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for ib.Stats().Processed < n {
		if time.Now().After(deadline) {
			t.Fatalf("inbox %q processed %d deliveries in %s, want %d (stats %+v)", ib.ConsumerName(), ib.Stats().Processed, timeout, n, ib.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// RequireProcessedOnce fails t unless store holds exactly one processed row for key, and no
// attempt record (a processed message leaves none).
func RequireProcessedOnce(t testing.TB, store *pgstore.Store, key inbox.Key) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	var rows, attempts int
	err := store.Pool().QueryRow(ctx, fmt.Sprintf(
		"SELECT (SELECT count(*) FROM %s WHERE message_id = $1 AND consumer_name = $2), (SELECT count(*) FROM %s WHERE message_id = $1 AND consumer_name = $2)",
		store.Table(), store.AttemptsTable()), key.MessageID, key.ConsumerName).Scan(&rows, &attempts)
	if err != nil {
		t.Fatalf("read the inbox of %q: %v", key.MessageID, err)
	}
	if rows != 1 || attempts != 0 {
		t.Fatalf("message %q for consumer %q: %d processed rows and %d attempt records, want 1 and 0", key.MessageID, key.ConsumerName, rows, attempts)
	}
}
