package router_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestStoreThenProcessRefusesStores: the store-then-process mode takes one database, so
// AddModeConsumer and AddModeHandler refuse an inbox.Config with Stores by a
// *router.ModeStoresError wrapping inbox.ErrInvalidConfig, and subscribe nothing; the
// immediate mode takes the same configuration.
func TestStoreThenProcessRefusesStores(t *testing.T) {
	route, err := inbox.RouteFromMetadata("tenant")
	if err != nil {
		t.Fatal(err)
	}
	icfg := inbox.Config{ConsumerName: "billing", Route: route,
		Stores: map[string]inbox.Store{"a": storetest.NewMemStore(), "b": storetest.NewMemStore()}}
	h := func(*message.Message) error { return nil }

	r, err := router.New(router.Config{Broker: "fake", Mode: router.ModeStoreThenProcess}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	_, _, errConsumer := r.AddModeConsumer(icfg, deferred.Config{}, "payments", h, nil)
	_, _, errHandler := r.AddModeHandler(icfg, deferred.Config{}, "payments", "receipts",
		func(*message.Message) ([]*message.Message, error) { return nil, nil }, nil)
	for _, err := range []error{errConsumer, errHandler} {
		var mse *router.ModeStoresError
		if !errors.As(err, &mse) || !errors.Is(err, inbox.ErrInvalidConfig) || mse.Routes != 2 || mse.Mode != router.ModeStoreThenProcess ||
			!strings.Contains(err.Error(), "store-then-process takes one database") {
			t.Errorf("store-then-process with Stores: err = %v, want a *ModeStoresError (2 routes) wrapping inbox.ErrInvalidConfig", err)
		}
	}
	if n := len(r.Handlers()); n != 0 {
		t.Errorf("the refused configurations added %d handlers, want 0", n)
	}

	imm, err := router.New(router.Config{Broker: "fake"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer imm.Close()
	if _, _, err := imm.AddModeConsumer(icfg, deferred.Config{}, "payments", h, nil); err != nil {
		t.Errorf("immediate mode with Stores: %v", err)
	}
}
