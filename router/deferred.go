package router

import (
	"context"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// The inbox modes of Config.Mode.
const (
	// ModeImmediate runs the handler inside the delivery, in the claim's transaction, and
	// acks after its commit (package middleware/inbox). The default.
	ModeImmediate = "immediate"
	// ModeStoreThenProcess stores the delivery (pending), commits and acks; workers run the
	// handler later (package middleware/deferred). See docs/store-then-process.md.
	ModeStoreThenProcess = "store-then-process"
)

// Modes lists the values Config.Mode accepts.
var Modes = []string{ModeImmediate, ModeStoreThenProcess}

func (c *Config) setModeDefault() {
	c.Mode = strings.ToLower(strings.TrimSpace(c.Mode))
	if c.Mode == "" {
		c.Mode = ModeImmediate
	}
}

func (c Config) validateMode() error {
	switch c.Mode {
	case "", ModeImmediate, ModeStoreThenProcess:
		return nil
	}
	return fmt.Errorf("%w: router: unknown mode %q in %s (one of %s)", inbox.ErrInvalidConfig, c.Mode,
		c.setting("INBOX_MODE", "mode", "Mode"), strings.Join(Modes, ", "))
}

// ModeStoresError is the error AddModeConsumer and AddModeHandler return in the
// store-then-process mode for an inbox.Config that sets Stores (or Route): a deferred inbox
// stores its pending rows in one database, deferred.Config.Pool, and its workers poll that one,
// so it does not route messages over several databases. It wraps inbox.ErrInvalidConfig. Run
// one router per database in that mode, or the immediate mode (see docs/scaling.md, "A
// database per tenant or per shard").
type ModeStoresError struct {
	// Mode is the router's mode, ModeStoreThenProcess.
	Mode string
	// Routes is the number of routes in inbox.Config.Stores.
	Routes int
}

// Error returns "inbox: invalid configuration: router: mode store-then-process takes one
// database: inbox.Config.Stores (N routes) is for the immediate mode".
func (e *ModeStoresError) Error() string {
	return fmt.Sprintf("%v: router: mode %s takes one database: inbox.Config.Stores (%d routes) is for the %s mode",
		inbox.ErrInvalidConfig, e.Mode, e.Routes, ModeImmediate)
}

// Unwrap returns inbox.ErrInvalidConfig.
func (e *ModeStoresError) Unwrap() error { return inbox.ErrInvalidConfig }

// Mode returns the router's inbox mode (ModeImmediate or ModeStoreThenProcess).
func (r *Router) Mode() string {
	if r.mode == "" {
		return ModeImmediate
	}
	return r.mode
}

// AddModeConsumer subscribes the same handler h to topic in the configured mode (Config.Mode):
//
//   - immediate: NewInbox(icfg) and AddConsumer, as before; it returns the inbox.
//   - store-then-process: a deferred.Inbox built from dcfg, with what dcfg leaves unset taken
//     from icfg (ConsumerName, KeyExtractor, the dead-letter publisher and topic, MaxAttempts,
//     OnKeyCollision, the Outbox) and from the broker (BrokerSideFields), and Pool from
//     icfg.Store when it is a *pgstore.Store. Its receipt (deferred.Inbox.Receive) is the
//     handler the router subscribes; its Workers run h and start with Run and stop with
//     Close. It returns the deferred inbox (for Stats, Replay). It takes one database: an
//     icfg with Stores or Route is refused with a *ModeStoresError.
//
// The store-then-process table must be migrated first (deferred.Inbox.Migrate, or
// `watermill-inbox deferred migrate`). Errors: those of NewInbox, deferred.New and
// AddConsumer, and *ModeStoresError.
func (r *Router) AddModeConsumer(icfg inbox.Config, dcfg deferred.Config, topic string, h message.NoPublishHandlerFunc, logger watermill.LoggerAdapter) (any, *message.Handler, error) {
	if r.Mode() == ModeImmediate {
		ib, err := r.NewInbox(icfg, logger)
		if err != nil {
			return nil, nil, err
		}
		handler, err := r.AddConsumer(ib, topic, h)
		return ib, handler, err
	}
	return r.addDeferred(icfg, dcfg, topic, func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) }, logger)
}

// addDeferred builds the deferred inbox of AddModeConsumer and AddModeHandler, subscribes its
// receipt to topic and registers its Workers running h.
func (r *Router) addDeferred(icfg inbox.Config, dcfg deferred.Config, topic string, h message.HandlerFunc, logger watermill.LoggerAdapter) (any, *message.Handler, error) {
	if icfg.Stores != nil || icfg.Route != nil {
		return nil, nil, &ModeStoresError{Mode: r.Mode(), Routes: len(icfg.Stores)}
	}
	if dcfg.ConsumerName == "" {
		dcfg.ConsumerName = icfg.ConsumerName
	}
	if dcfg.KeyExtractor == nil {
		dcfg.KeyExtractor = icfg.KeyExtractor
	}
	if dcfg.DeadLetterPublisher == nil && dcfg.DeadLetterTopic == "" {
		dcfg.DeadLetterPublisher, dcfg.DeadLetterTopic = icfg.DeadLetterPublisher, icfg.DeadLetterTopic
	}
	if dcfg.MaxAttempts == 0 {
		dcfg.MaxAttempts = icfg.MaxAttempts
	}
	if dcfg.OnKeyCollision == 0 {
		dcfg.OnKeyCollision = icfg.OnKeyCollision
	}
	if dcfg.Outbox == nil {
		dcfg.Outbox = icfg.Outbox
	}
	if dcfg.BrokerSideFields == nil {
		dcfg.BrokerSideFields = r.Broker.BrokerSideFields
	}
	if st, ok := icfg.Store.(*pgstore.Store); ok && dcfg.Pool == nil {
		dcfg.Pool = st.Pool()
	}
	ib, err := deferred.New(dcfg, logger)
	if err != nil {
		return nil, nil, err
	}
	sub, name, err := r.subscriberFor(ib.ConsumerName(), topic)
	if err != nil {
		return nil, nil, err
	}
	handler := r.AddConsumerHandler(name, topic, sub, ib.Receive)
	r.mu.Lock()
	r.ws = append(r.ws, ib.NewWorkers(h))
	r.mu.Unlock()
	return ib, handler, nil
}

// runWorkers starts the store-then-process workers (once), stopped by ctx or Close.
func (r *Router) runWorkers(ctx context.Context) {
	r.mu.Lock()
	ws := r.ws
	if r.wsRun {
		ws = nil
	}
	r.wsRun = true
	r.mu.Unlock()
	for _, w := range ws {
		go func() { _ = w.Run(ctx) }()
	}
}

// closeWorkers stops the workers gracefully (see deferred.Workers.Close).
func (r *Router) closeWorkers() {
	r.mu.Lock()
	ws := r.ws
	r.mu.Unlock()
	for _, w := range ws {
		_ = w.Close()
	}
}

// AddModeHandler is AddModeConsumer for a handler that returns messages for publishTopic: in
// the immediate mode NewInbox(icfg) and AddPublishingConsumer; in the store-then-process mode the
// deferred inbox built as AddModeConsumer builds it, with dcfg.PublishTopic set to publishTopic
// (when unset), whose Workers write h's messages through the Outbox (icfg.Outbox when
// dcfg.Outbox is unset) in each row's transaction. It returns the *inbox.Inbox or the
// *deferred.Inbox. Errors: those of NewInbox, deferred.New and AddPublishingConsumer, and
// *ModeStoresError (store-then-process with icfg.Stores).
func (r *Router) AddModeHandler(icfg inbox.Config, dcfg deferred.Config, topic, publishTopic string, h message.HandlerFunc, logger watermill.LoggerAdapter) (any, *message.Handler, error) {
	if r.Mode() == ModeImmediate {
		ib, err := r.NewInbox(icfg, logger)
		if err != nil {
			return nil, nil, err
		}
		handler, err := r.AddPublishingConsumer(ib, topic, publishTopic, h)
		return ib, handler, err
	}
	if dcfg.PublishTopic == "" {
		dcfg.PublishTopic = publishTopic
	}
	return r.addDeferred(icfg, dcfg, topic, h, logger)
}
