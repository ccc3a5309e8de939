package inboxmetrics_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxmetrics"
)

// TestDistinctKeysCreateNoSeries delivers 10,000 messages with distinct keys (each processed,
// then each delivered again as a duplicate) through the real middleware on the reference
// in-memory store: the number of series in the registry does not grow with the keys.
func TestDistinctKeysCreateNoSeries(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := inboxmetrics.New(reg, inboxmetrics.Options{})
	if err != nil {
		t.Fatal(err)
	}
	store := storetest.NewMemStore()
	obs, err := m.NewObserver("c")
	if err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "c", Observer: obs}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := ib.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	deliver := func(id string) {
		msg := message.NewMessage(id, []byte("x"))
		msg.SetContext(context.Background())
		if _, err := h(msg); err != nil {
			t.Fatal(err)
		}
	}
	deliver("first")
	deliver("first")
	before := series(t, reg)
	const keys = 10000
	for i := range keys {
		id := fmt.Sprintf("key-%d", i)
		deliver(id)
		deliver(id)
	}
	if after := series(t, reg); after != before {
		t.Fatalf("series grew from %d to %d over %d distinct keys", before, after, keys)
	}
	if got := value(t, reg, "watermill_inbox_deliveries_total", map[string]string{"outcome": "processed"}); got != keys+1 {
		t.Fatalf("processed %v, want %d", got, keys+1)
	}
	if got := value(t, reg, "watermill_inbox_deliveries_total", map[string]string{"outcome": "duplicate"}); got != keys+1 {
		t.Fatalf("duplicates %v, want %d", got, keys+1)
	}
	if s := ib.Stats(); s.Processed != keys+1 || s.Duplicates != keys+1 {
		t.Fatalf("stats %+v", s)
	}
}

// TestNewRequiresRegisterer: registration is explicit; a second New on one registry fails.
func TestNewRequiresRegisterer(t *testing.T) {
	if _, err := inboxmetrics.New(nil, inboxmetrics.Options{}); err == nil {
		t.Fatal("New(nil) succeeded")
	}
	reg := prometheus.NewRegistry()
	if _, err := inboxmetrics.New(reg, inboxmetrics.Options{}); err != nil {
		t.Fatal(err)
	}
	if _, err := inboxmetrics.New(reg, inboxmetrics.Options{}); err == nil {
		t.Fatal("a second New on the same registry succeeded")
	}
}
