package redis

import (
	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/internal/defaults"
)

// DefaultURL is the URL of the registered "redis" broker when none is configured (database 0).
const DefaultURL = defaults.RedisURL

// Importing the package registers the "redis" broker: Spec.URL is the Redis URL (default
// DefaultURL, environment INBOX_REDIS_URL), Spec.Settings a Config (or *Config) or nil.
func init() {
	adapters.Register(Name, adapters.Driver{
		DefaultURL: DefaultURL,
		URLEnv:     "INBOX_REDIS_URL",
		Open: func(spec adapters.Spec, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
			c, err := adapters.SettingsAs[Config](Name, spec.Settings)
			if err != nil {
				return nil, err
			}
			c.URL, c.ConsumerGroup = spec.URL, spec.ConsumerGroup
			return New(c, logger)
		},
	})
}
