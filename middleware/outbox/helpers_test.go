package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// env is one test's database: a fresh schema with the inbox table, the outbox tables (in the
// search_path schema, unqualified) and ten accounts at balance 0.
type env struct {
	t     *testing.T
	sch   *testenv.Schema
	store *pgstore.Store
	cfg   outbox.Config
}

func newEnv(t *testing.T, conns int32) *env {
	t.Helper()
	sch := testenv.NewSchema(t, conns)
	store := sch.Store(t)
	sch.CreateAccounts(t, 10)
	ctx := t.Context()
	cfg := outbox.Config{}
	if err := outbox.InitializeSchema(ctx, sch.Pool, cfg); err != nil {
		t.Fatal(err)
	}
	return &env{t: t, sch: sch, store: store, cfg: cfg}
}

func (e *env) int(sql string, args ...any) int64 {
	e.t.Helper()
	var n int64
	if err := e.sch.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func (e *env) mustExec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.sch.Pool.Exec(context.Background(), sql, args...); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
}

func (e *env) balance(account int) int64 {
	return e.int("SELECT balance FROM accounts WHERE id = $1", account)
}

func (e *env) outboxRows() int64 { return e.int("SELECT count(*) FROM " + e.cfg.MessagesTable()) }
func (e *env) inboxRows() int64  { return e.int("SELECT count(*) FROM " + e.store.Table()) }

type payment struct {
	Account int   `json:"account"`
	Amount  int64 `json:"amount"`
}

func paymentMsg(id string, account int, amount int64) *message.Message {
	b, _ := json.Marshal(payment{account, amount})
	return message.NewMessage(id, b)
}

// credit adds the payment to its account in the inbox transaction.
func credit(msg *message.Message) error {
	var p payment
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return inbox.Permanent(err)
	}
	tx, ok := pgstore.TxFromContext(msg.Context())
	if !ok {
		return errors.New("no inbox transaction in the context")
	}
	_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + $1 WHERE id = $2", p.Amount, p.Account)
	return err
}

// produced returns the two events a credit produces, with IDs and metadata derived from the
// input, so a test knows what the relay must deliver.
func produced(in *message.Message) []*message.Message {
	out := make([]*message.Message, 2)
	for i, kind := range []string{"AccountCredited", "ReceiptRequested"} {
		m := message.NewMessage(fmt.Sprintf("%s/%d", in.UUID, i+1), []byte(fmt.Sprintf(`{"source":%q,"kind":%q}`, in.UUID, kind)))
		m.Metadata.Set("name", kind)
		m.Metadata.Set("source_message", in.UUID)
		m.Metadata.Set("correlation_id", "corr-"+in.UUID)
		out[i] = m
	}
	return out
}

// refusingPublisher is the router's publisher for handlers whose output goes to the outbox:
// the router must never publish through it.
type refusingPublisher struct{ calls atomic.Int64 }

func (p *refusingPublisher) Publish(string, ...*message.Message) error {
	p.calls.Add(1)
	return errors.New("the router must not publish: produced messages go to the outbox")
}
func (p *refusingPublisher) Close() error { return nil }

// newGoChannel is an in-memory Pub/Sub whose Publish returns only once the subscriber acked
// (a nack is redelivered and Publish keeps waiting).
func newGoChannel() *gochannel.GoChannel {
	return gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
}

// runRouter runs r until the test ends.
func runRouter(t *testing.T, r *message.Router) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = r.Run(context.Background())
	}()
	select {
	case <-r.Running():
	case <-time.After(10 * time.Second):
		t.Fatal("router did not start")
	}
	t.Cleanup(func() {
		_ = r.Close()
		<-done
	})
}

// publishAcked publishes m on pub and fails t unless the subscriber acked it within 10 s.
func publishAcked(t *testing.T, pub message.Publisher, topic string, m *message.Message) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- pub.Publish(topic, m) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("message %q was never acked", m.UUID)
	}
}

// errorCatcher is an outer middleware that records each delivery's error and acks it, so a
// refused delivery does not loop on GoChannel.
type errorCatcher struct {
	mu   sync.Mutex
	errs []error
}

func (c *errorCatcher) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		out, err := h(msg)
		c.mu.Lock()
		c.errs = append(c.errs, err)
		c.mu.Unlock()
		return out, nil
	}
}

func (c *errorCatcher) all() []error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]error(nil), c.errs...)
}

// startRelay runs a relay until the test ends and returns it with Run's result channel.
func startRelay(t *testing.T, cfg outbox.RelayConfig) (*outbox.Relay, <-chan error) {
	t.Helper()
	r, err := outbox.NewRelay(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("relay stopped before running: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("relay did not start")
	}
	t.Cleanup(func() { _ = r.Close() })
	return r, done
}

// stopRelay closes r and fails t when Close does. A relay counts a batch in Stats and reports
// it to OnBatch only after the batch's transaction committed, so a test that saw the
// committed offset (waitAllAcked) can read Stats before they include that batch; once Close
// returned, the SQL subscriber's goroutine has ended, every batch's Commit or Rollback with
// it, and Stats and the OnBatch reports are final.
func stopRelay(t *testing.T, r *outbox.Relay) {
	t.Helper()
	if err := r.Close(); err != nil {
		t.Fatalf("closing the relay: %v", err)
	}
}

// collect reads n messages from ch, acking each, and fails t after timeout.
func collect(t *testing.T, ch <-chan *message.Message, n int, timeout time.Duration) []*message.Message {
	t.Helper()
	var got []*message.Message
	deadline := time.After(timeout)
	for len(got) < n {
		select {
		case m := <-ch:
			m.Ack()
			got = append(got, m)
		case <-deadline:
			t.Fatalf("received %d of %d relayed messages within %s", len(got), n, timeout)
		}
	}
	return got
}
