package tests

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestCorrelationIDThroughTheOutbox: on RabbitMQ, through package router (whose router-level
// middleware includes Watermill's CorrelationID), a handler returns events without a
// correlation ID; the inbox stores them in the outbox inside its transaction, where the
// CorrelationID middleware would come too late, and the relay publishes them. Each event
// reaches its downstream consumer with the correlation ID of the order that caused it, as it
// would without the outbox; an event that set its own keeps it.
func TestCorrelationIDThroughTheOutbox(t *testing.T) {
	url := testenv.RequireAMQP(t)
	sch := testenv.NewSchema(t, 8)
	store := sch.Store(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	suffix := watermill.NewShortUUID()
	orders, events := "corr_orders_"+suffix, "corr_events_"+suffix
	obCfg := outbox.Config{Topic: "corr_outbox"}
	if err := outbox.InitializeSchema(ctx, sch.Pool, obCfg); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(obCfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := router.New(router.Config{Broker: "amqp", URL: url, ConsumerGroupPrefix: "corr_" + suffix + "_"}, sch.Pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	billing, err := r.NewInbox(inbox.Config{Store: store, ConsumerName: "billing", Outbox: ob}, nil)
	if err != nil {
		t.Fatal(err)
	}
	audit, err := r.NewInbox(inbox.Config{Store: store, ConsumerName: "audit"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.AddPublishingConsumer(billing, orders, events, func(msg *message.Message) ([]*message.Message, error) {
		ev := message.NewMessage(watermill.NewUUID(), msg.Payload)
		if string(msg.Payload) == "own" {
			wmmiddleware.SetCorrelationID("set-by-handler", ev)
		}
		return []*message.Message{ev}, nil
	}); err != nil {
		t.Fatal(err)
	}
	got := make(chan [2]string, 10)
	if _, err := r.AddConsumer(audit, events, func(msg *message.Message) error {
		tx, _ := pgstore.TxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), "SELECT 1"); err != nil {
			return err
		}
		got <- [2]string{string(msg.Payload), wmmiddleware.MessageCorrelationID(msg)}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(outbox.RelayConfig{Config: obCfg, Pool: sch.Pool, Publisher: r.Broker.Publisher, PollInterval: 20 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = relay.Run(ctx) }()
	defer relay.Close()
	go func() { _ = r.Run(ctx) }()
	defer r.Close()
	<-r.Running()

	const n = 5
	for i := range n {
		m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("order-%d", i)))
		wmmiddleware.SetCorrelationID(fmt.Sprintf("corr-%d", i), m)
		if err := r.Broker.Publisher.Publish(orders, m); err != nil {
			t.Fatal(err)
		}
	}
	own := message.NewMessage(watermill.NewUUID(), []byte("own"))
	wmmiddleware.SetCorrelationID("from-the-order", own)
	if err := r.Broker.Publisher.Publish(orders, own); err != nil {
		t.Fatal(err)
	}
	seen := map[string]string{}
	for len(seen) < n+1 {
		select {
		case g := <-got:
			seen[g[0]] = g[1]
		case <-ctx.Done():
			t.Fatalf("events received: %v", seen)
		}
	}
	for i := range n {
		if c := seen[fmt.Sprintf("order-%d", i)]; c != fmt.Sprintf("corr-%d", i) {
			t.Errorf("event of order-%d carries correlation ID %q, want corr-%d", i, c, i)
		}
	}
	if c := seen["own"]; c != "set-by-handler" {
		t.Errorf("an event with its own correlation ID arrived with %q", c)
	}
	// The handler reports an event before its inbox transaction commits: wait for the commit.
	var rows int
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+store.Table()+" WHERE consumer_name = 'audit'").Scan(&rows)
		if err == nil && rows == n+1 {
			break
		}
		if err != nil || time.Now().After(deadline) {
			t.Fatalf("audit inbox rows %d (%v), want %d", rows, err, n+1)
		}
	}
}
