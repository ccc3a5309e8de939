package adapters

import (
	"fmt"
	"slices"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Spec is what a configuration says about a broker, whatever the broker: what package router
// passes to the Open function of the registered Driver.
type Spec struct {
	// URL is the broker's address, after the Driver's DefaultURL filled an empty one; its
	// meaning is the adapter's (see each adapter's Config).
	URL string
	// ConsumerGroup is the consumer group of the Broker's default Subscriber.
	ConsumerGroup string
	// Pool is the inbox's database; the postgres broker uses it as the broker too.
	Pool *pgxpool.Pool
	// QueryProtocol asks the sqs broker to speak the AWS query protocol (an SQS-compatible
	// endpoint such as goaws). Other drivers ignore it.
	QueryProtocol bool
	// Settings is nil (the adapter's defaults) or the adapter's own configuration, as a value
	// or a pointer (amqp.Config, kafka.Config, sqs.BrokerConfig...): Open copies it and fills
	// in URL, ConsumerGroup and Pool. Open returns an error for a value of another type.
	Settings any
}

// Driver is how package router builds one broker from configuration. An adapter package
// registers its Driver in its init function, under its Name, as database/sql drivers do:
// importing the adapter (or package adapters/all, which imports every one) is what makes a
// broker name configurable.
type Driver struct {
	// Open builds the broker (required). Its errors are the adapter's New's.
	Open func(spec Spec, logger watermill.LoggerAdapter) (*Broker, error)
	// DefaultURL is the URL used when none is configured ("" for none).
	DefaultURL string
	// URLEnv names an environment variable router.ConfigFromEnv reads for the URL when
	// INBOX_BROKER_URL is unset ("" for none).
	URLEnv string
	// ValidateURL checks a configured URL before anything connects (nil: any URL, including
	// none). Its error says what is wrong with the URL; router names the setting and wraps
	// inbox.ErrInvalidConfig.
	ValidateURL func(url string) error
}

var (
	driversMu sync.RWMutex
	drivers   = map[string]Driver{}
)

// Register makes a broker available under name. It panics when name is empty, d.Open is nil,
// or name is registered already (two adapters claiming one name is a programming error, as in
// database/sql.Register).
func Register(name string, d Driver) {
	driversMu.Lock()
	defer driversMu.Unlock()
	if name == "" || d.Open == nil {
		panic("adapters: Register of an empty name or a nil Open")
	}
	if _, dup := drivers[name]; dup {
		panic(fmt.Sprintf("adapters: Register called twice for broker %q", name))
	}
	drivers[name] = d
}

// Lookup returns the Driver registered under name.
func Lookup(name string) (Driver, bool) {
	driversMu.RLock()
	defer driversMu.RUnlock()
	d, ok := drivers[name]
	return d, ok
}

// Registered returns the registered broker names, sorted.
func Registered() []string {
	driversMu.RLock()
	defer driversMu.RUnlock()
	names := make([]string, 0, len(drivers))
	for n := range drivers {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// SettingsAs returns the zero T for nil settings, *s for a *T, s for a T, and an error for any
// other type (wrapping inbox.ErrInvalidConfig): the copy of Spec.Settings a Driver's Open fills in.
func SettingsAs[T any](name string, s any) (T, error) {
	var v T
	switch c := s.(type) {
	case nil:
		return v, nil
	case T:
		return c, nil
	case *T:
		if c != nil {
			v = *c
		}
		return v, nil
	}
	return v, fmt.Errorf("%w: %s adapter: settings of type %T, want %T", inbox.ErrInvalidConfig, name, s, v)
}
