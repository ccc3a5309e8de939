package router

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/keyrule"
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
// store-then-process mode for an inbox.Config with Stores (or Route) they cannot serve a
// deferred inbox per database for: Route without Stores, Stores without Route or empty, Store
// and Stores both set, a store that is not a *pgstore.Store (a deferred inbox needs the
// store's PostgreSQL pool), or deferred.Config.Pool set beside Stores (each database's pool is
// its store's). It wraps inbox.ErrInvalidConfig. See docs/scaling.md, "A database per tenant or
// per shard".
type ModeStoresError struct {
	// Mode is the router's mode, ModeStoreThenProcess.
	Mode string
	// Routes is the number of routes in inbox.Config.Stores.
	Routes int
	// Reason says what was refused, such as "Stores[a] is not a *pgstore.Store".
	Reason string
}

// Error returns "inbox: invalid configuration: router: mode store-then-process with
// inbox.Config.Stores (N routes): <reason>".
func (e *ModeStoresError) Error() string {
	return fmt.Sprintf("%v: router: mode %s with inbox.Config.Stores (%d routes): %s",
		inbox.ErrInvalidConfig, e.Mode, e.Routes, e.Reason)
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
//     Close. It returns the deferred inbox (for Stats, Replay).
//   - store-then-process with icfg.Stores and icfg.Route (a database per tenant or per
//     shard): one deferred inbox per distinct database (per distinct pool of the stores, each
//     a *pgstore.Store), each built from dcfg as above with its store's pool, so each keeps
//     its table in its own database. The receipt the router subscribes names each message's
//     route with icfg.Route and stores it in that route's database; a message with no route
//     (the RouteFunc's error, an empty or unknown name) is refused with the permanent
//     *inbox.RouteError the immediate mode gives: dead-lettered and acked with a dead-letter
//     topic, else returned (see deferred.Inbox.Refuse; counted in the Refused counter of the
//     inbox of the first route name in sort order). Workers run for every database and
//     start and stop with the router; a database that is down fails only its own receipts
//     and rows. It returns a map[string]*deferred.Inbox from route name to its database's
//     inbox (routes sharing a database share it). A configuration it cannot serve so is
//     refused with a *ModeStoresError.
//
// The store-then-process table must be migrated first (deferred.Inbox.Migrate, or
// `watermill-inbox deferred migrate`), in every database with icfg.Stores. Errors: those of
// NewInbox, deferred.New and AddConsumer, and *ModeStoresError.
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

// addDeferred builds the deferred inbox (or, with icfg.Stores, the deferred inboxes) of
// AddModeConsumer and AddModeHandler, subscribes the receipt to topic and registers the
// Workers running h.
func (r *Router) addDeferred(icfg inbox.Config, dcfg deferred.Config, topic string, h message.HandlerFunc, logger watermill.LoggerAdapter) (any, *message.Handler, error) {
	dcfg = r.deferredDefaults(icfg, dcfg)
	if icfg.Stores != nil || icfg.Route != nil {
		return r.addRoutedDeferred(icfg, dcfg, topic, h, logger)
	}
	if st, ok := icfg.Store.(*pgstore.Store); ok && dcfg.Pool == nil {
		dcfg.Pool = st.Pool()
	}
	ib, err := deferred.New(dcfg, logger)
	if err != nil {
		return nil, nil, err
	}
	handler, err := r.subscribeDeferred(ib.ConsumerName(), topic, ib.Receive, []*deferred.Workers{ib.NewWorkers(h)})
	if err != nil {
		return nil, nil, err
	}
	return ib, handler, nil
}

// deferredDefaults fills what dcfg leaves unset from icfg and the broker.
func (r *Router) deferredDefaults(icfg inbox.Config, dcfg deferred.Config) deferred.Config {
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
	return dcfg
}

// subscribeDeferred subscribes receive to topic and registers ws to run with the router.
func (r *Router) subscribeDeferred(consumer, topic string, receive message.NoPublishHandlerFunc, ws []*deferred.Workers) (*message.Handler, error) {
	sub, name, err := r.subscriberFor(consumer, topic)
	if err != nil {
		return nil, err
	}
	handler := r.AddConsumerHandler(name, topic, sub, receive)
	r.mu.Lock()
	r.ws = append(r.ws, ws...)
	r.mu.Unlock()
	return handler, nil
}

// routedPools checks icfg's Stores and Route for the store-then-process mode and returns the
// sorted route names and each route's pool.
func (r *Router) routedPools(icfg inbox.Config, dcfg deferred.Config) ([]string, map[string]*pgxpool.Pool, error) {
	refuse := func(reason string) error {
		return &ModeStoresError{Mode: r.Mode(), Routes: len(icfg.Stores), Reason: reason}
	}
	switch {
	case icfg.Route == nil:
		return nil, nil, refuse("Stores needs Route")
	case len(icfg.Stores) == 0:
		return nil, nil, refuse("Route needs Stores (none given)")
	case icfg.Store != nil:
		return nil, nil, refuse("set Store or Stores, not both")
	case dcfg.Pool != nil:
		return nil, nil, refuse("deferred.Config.Pool is set: each database's pool is its store's")
	}
	names := make([]string, 0, len(icfg.Stores))
	pools := make(map[string]*pgxpool.Pool, len(icfg.Stores))
	for name, s := range icfg.Stores {
		if p := keyrule.Problem(name); p != "" {
			return nil, nil, refuse(fmt.Sprintf("route name %s: %s", keyrule.SafeID(name), p))
		}
		st, ok := s.(*pgstore.Store)
		if !ok || st == nil {
			return nil, nil, refuse(fmt.Sprintf("Stores[%s] is not a *pgstore.Store", keyrule.SafeID(name)))
		}
		names = append(names, name)
		pools[name] = st.Pool()
	}
	sort.Strings(names)
	return names, pools, nil
}

// addRoutedDeferred is addDeferred with icfg.Stores: a deferred inbox per distinct pool, a
// receipt that routes each message to its route's, and the workers of every one.
func (r *Router) addRoutedDeferred(icfg inbox.Config, dcfg deferred.Config, topic string, h message.HandlerFunc, logger watermill.LoggerAdapter) (any, *message.Handler, error) {
	names, pools, err := r.routedPools(icfg, dcfg)
	if err != nil {
		return nil, nil, err
	}
	byPool := map[*pgxpool.Pool]*deferred.Inbox{}
	byRoute := make(map[string]*deferred.Inbox, len(names))
	var ws []*deferred.Workers
	for _, name := range names {
		ib, ok := byPool[pools[name]]
		if !ok {
			cfg := dcfg
			cfg.Pool = pools[name]
			if ib, err = deferred.New(cfg, logger); err != nil {
				return nil, nil, fmt.Errorf("router: deferred inbox of route %s: %w", keyrule.SafeID(name), err)
			}
			byPool[pools[name]] = ib
			ws = append(ws, ib.NewWorkers(h))
		}
		byRoute[name] = ib
	}
	first := byRoute[names[0]]
	route := icfg.Route
	receive := func(msg *message.Message) error {
		name, err := route(msg)
		switch {
		case err != nil:
			return first.Refuse(msg, &inbox.RouteError{Reason: err.Error()})
		case name == "":
			return first.Refuse(msg, &inbox.RouteError{Reason: "empty route"})
		}
		ib, ok := byRoute[name]
		if !ok {
			return first.Refuse(msg, &inbox.RouteError{Route: name, Reason: "unknown route"})
		}
		return ib.Receive(msg)
	}
	handler, err := r.subscribeDeferred(first.ConsumerName(), topic, receive, ws)
	if err != nil {
		return nil, nil, err
	}
	return byRoute, handler, nil
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
// *deferred.Inbox (with icfg.Stores, a map[string]*deferred.Inbox from route name to its
// database's inbox, as AddModeConsumer). Errors: those of NewInbox, deferred.New and
// AddPublishingConsumer, and *ModeStoresError (store-then-process with icfg.Stores it cannot
// serve).
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
