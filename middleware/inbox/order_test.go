package inbox_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// canonicalOrder is the one middleware order the project documents: README.md and
// docs/design.md repeat these lines verbatim, and TestCanonicalMiddlewareOrder runs them.
const canonicalOrder = `poisonQueue, err := middleware.PoisonQueueWithFilter(pub, "payments.poison", inbox.IsPermanent) // only what redelivery cannot fix
wmRouter.AddMiddleware(
	middleware.CorrelationID, // outermost: produced messages get the received message's correlation ID
	middleware.Recoverer,     // a panic becomes an error (and a nack), never a crash
	poisonQueue,
	middleware.Retry{MaxRetries: 3, InitialInterval: 100 * time.Millisecond, ResetContextOnRetry: true}.Middleware,
	middleware.Timeout(30*time.Second), // inside Retry: every try gets its own deadline
)
h := wmRouter.AddConsumerHandler("billing", "payments", sub, handler)
h.AddMiddleware(ib.Middleware) // the inbox, last: innermost, so each try is one transaction`

// TestCanonicalMiddlewareOrder runs the documented order on GoChannel: a handler that times
// out once, fails once with a transient error and once with a panic before succeeding is
// applied once; a permanent error lands on the poison topic once; and README.md and
// docs/design.md show exactly canonicalOrder.
func TestCanonicalMiddlewareOrder(t *testing.T) {
	for _, doc := range []string{"../../README.md", "../../docs/design.md"} {
		raw, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(normalise(string(raw)), normalise(canonicalOrder)) {
			t.Errorf("%s does not show the canonical middleware order (middleware/inbox/order_test.go) verbatim", doc)
		}
	}

	e := newEnv(t, 6)
	sub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
	pub := sub
	poison, err := sub.Subscribe(context.Background(), "payments.poison")
	if err != nil {
		t.Fatal(err)
	}
	ib := e.inbox("billing")
	var tries atomic.Int32
	handler := func(msg *message.Message) error {
		if string(msg.Payload) == "malformed" {
			return inbox.Permanent(errors.New("malformed payment"))
		}
		switch tries.Add(1) {
		case 1:
			<-msg.Context().Done() // the try times out
			return msg.Context().Err()
		case 2:
			return errors.New("ledger briefly unavailable")
		case 3:
			panic("bug on a rare path")
		}
		tx, _ := pgstore.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 5 WHERE id = 1")
		return err
	}
	wmRouter, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	// --- the canonical order, as in canonicalOrder (but a short Timeout for the test) ---
	poisonQueue, err := middleware.PoisonQueueWithFilter(pub, "payments.poison", inbox.IsPermanent)
	if err != nil {
		t.Fatal(err)
	}
	wmRouter.AddMiddleware(
		middleware.CorrelationID,
		middleware.Recoverer,
		poisonQueue,
		middleware.Retry{MaxRetries: 3, InitialInterval: 100 * time.Millisecond, ResetContextOnRetry: true}.Middleware,
		middleware.Timeout(500*time.Millisecond),
	)
	h := wmRouter.AddConsumerHandler("billing", "payments", sub, handler)
	h.AddMiddleware(ib.Middleware)
	// ---
	go func() { _ = wmRouter.Run(context.Background()) }()
	<-wmRouter.Running()
	defer wmRouter.Close()
	if err := pub.Publish("payments", message.NewMessage("pay-1", []byte("ok")), message.NewMessage("pay-2", []byte("malformed"))); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-poison:
		m.Ack()
		if m.UUID != "pay-2" {
			t.Fatalf("poisoned %s, want pay-2", m.UUID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the permanent error did not reach the poison topic")
	}
	deadline := time.Now().Add(10 * time.Second)
	for ib.Stats().Processed < 1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if b, n := e.balance(1), tries.Load(); b != 5 || n != 4 {
		t.Fatalf("balance %d after %d tries; want 5 after 4 (timeout, error, panic, success)", b, n)
	}
}

// normalise drops indentation and blank lines, so a snippet matches inside Markdown.
func normalise(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, strings.Join(strings.Fields(l), " "))
		}
	}
	return strings.Join(out, "\n")
}
