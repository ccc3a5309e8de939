package postgres

import (
	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-inbox/watermill-inbox/adapters"
)

// Importing the package registers the "postgres" broker: the inbox's pool (Spec.Pool) is the
// broker, Spec.Settings a Config (or *Config) or nil.
func init() {
	adapters.Register(Name, adapters.Driver{Open: func(spec adapters.Spec, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
		c, err := adapters.SettingsAs[Config](Name, spec.Settings)
		if err != nil {
			return nil, err
		}
		c.Pool, c.ConsumerGroup = spec.Pool, spec.ConsumerGroup
		return New(c, logger)
	}})
}
