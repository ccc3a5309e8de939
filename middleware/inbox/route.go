package inbox

import (
	"errors"
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"github.com/watermill-inbox/watermill-inbox/internal/keyrule"
)

// One consumer over several databases (a database per tenant or per shard): Config.Stores
// names the stores, Config.Route names each message's. See docs/scaling.md, "A database per
// tenant or per shard".

// RouteFunc returns the name of the store a message is claimed on: a key of Config.Stores,
// such as a tenant or shard name read from the message. An error, an empty name or a name
// that is not a key of Config.Stores refuses the message with a *RouteError (permanent).
//
// It must return the same name for every copy of a message: the inbox deduplicates per
// database, so a copy routed to another database is processed there a second time.
type RouteFunc func(msg *message.Message) (string, error)

// RouteFromMetadata returns a RouteFunc that reads the named metadata field (a tenant ID, a
// shard name the producer wrote once, with the message). A message without the field is
// refused with a *RouteError. It returns an error wrapping ErrInvalidConfig when field is
// blank, or wrapping ErrBrokerSideKey when field names a broker-side delivery field (the
// fields MetadataKey refuses): such a value changes on redelivery.
func RouteFromMetadata(field string) (RouteFunc, error) {
	if strings.TrimSpace(field) == "" {
		return nil, fmt.Errorf("%w: RouteFromMetadata: empty field name", ErrInvalidConfig)
	}
	if broker, why, ok := brokerside.Lookup(field); ok {
		return nil, fmt.Errorf("%w: %q (%s): %s", ErrBrokerSideKey, field, broker, why)
	}
	return func(msg *message.Message) (string, error) {
		if r := msg.Metadata.Get(field); r != "" {
			return r, nil
		}
		return "", fmt.Errorf("no metadata %q", field)
	}, nil
}

// ErrUnroutable is wrapped by every *RouteError.
var ErrUnroutable = errors.New("inbox: message has no store to claim on")

// RouteError reports why a message could not be given a store (Config.Route). It wraps
// ErrUnroutable and is permanent (see IsPermanent): nothing is claimed on any database and the
// handler does not run; with a dead-letter topic the message is dead-lettered with the error
// as its reason. Like an invalid key it counts in Stats.InvalidKeys and in the
// InvalidKeyBrake, so a mistyped route field nacks the stream instead of dead-lettering it.
type RouteError struct {
	// Route is the name Config.Route returned ("" when it returned an error).
	Route string
	// Reason is "unknown route", "empty route", or the RouteFunc's error.
	Reason string
}

// Error returns "inbox: no store for route <route>: <reason>"; the route is printed as
// keyrule.SafeID prints a key (quoted when it holds a control character, its length only
// when it is not valid key material).
func (e *RouteError) Error() string {
	if e.Route == "" {
		return "inbox: no store for the message: " + e.Reason
	}
	return fmt.Sprintf("inbox: no store for route %s: %s", keyrule.SafeID(e.Route), e.Reason)
}

// Unwrap returns ErrUnroutable.
func (e *RouteError) Unwrap() error { return ErrUnroutable }

// storeFor is the one rule that gives a message its store: Config.Store, or the store
// Config.Route names among Config.Stores. It returns the route ("" with a single Store).
func (i *Inbox) storeFor(msg *message.Message) (Store, string, error) {
	if i.cfg.Route == nil {
		return i.cfg.Store, "", nil
	}
	route, err := i.cfg.Route(msg)
	switch {
	case err != nil:
		return nil, "", &RouteError{Reason: err.Error()}
	case route == "":
		return nil, "", &RouteError{Reason: "empty route"}
	}
	s, ok := i.cfg.Stores[route]
	if !ok {
		return nil, "", &RouteError{Route: route, Reason: "unknown route"}
	}
	return s, route, nil
}

// stores returns the distinct stores of the configuration: Config.Store, or the values of
// Config.Stores (several routes may share a store).
func (c *Config) stores() []Store {
	if c.Stores == nil {
		if c.Store == nil {
			return nil
		}
		return []Store{c.Store}
	}
	seen := map[Store]bool{}
	var out []Store
	for _, s := range c.Stores {
		if s != nil && !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	return out
}

// validateStores checks Store, Stores and Route (see Config.Validate).
func (c *Config) validateStores() error {
	switch {
	case c.Store != nil && c.Stores != nil:
		return fmt.Errorf("%w: set Store or Stores, not both", ErrInvalidConfig)
	case c.Store == nil && c.Stores == nil:
		return fmt.Errorf("%w: Store is required", ErrInvalidConfig)
	case c.Stores != nil && len(c.Stores) == 0:
		return fmt.Errorf("%w: Stores is empty", ErrInvalidConfig)
	case c.Stores != nil && c.Route == nil:
		return fmt.Errorf("%w: Stores needs Route", ErrInvalidConfig)
	case c.Stores == nil && c.Route != nil:
		return fmt.Errorf("%w: Route needs Stores", ErrInvalidConfig)
	}
	for name, s := range c.Stores {
		if s == nil {
			return fmt.Errorf("%w: Stores[%s] is nil", ErrInvalidConfig, keyrule.SafeID(name))
		}
		if p := keyrule.Problem(name); p != "" {
			return fmt.Errorf("%w: Stores: route name %s: %s", ErrInvalidConfig, keyrule.SafeID(name), p)
		}
	}
	return nil
}
