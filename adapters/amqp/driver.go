package amqp

import (
	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/internal/defaults"
)

// DefaultURL is the URL of the registered "amqp" broker when none is configured: the local
// RabbitMQ with its default guest account.
const DefaultURL = defaults.AMQPURL

// Importing the package registers the "amqp" broker: Spec.URL is the AMQP URI (default
// DefaultURL, environment INBOX_AMQP_URL), Spec.Settings a Config (or *Config) or nil. The
// default Subscriber consumes from a queue named after the topic; router declares a consumer
// group's queue when its consumer is added (Broker.SubscribeInitialize).
func init() {
	adapters.Register(Name, adapters.Driver{
		DefaultURL: DefaultURL,
		URLEnv:     "INBOX_AMQP_URL",
		Open: func(spec adapters.Spec, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
			c, err := adapters.SettingsAs[Config](Name, spec.Settings)
			if err != nil {
				return nil, err
			}
			c.URL = spec.URL
			b, err := New(c, logger)
			if err != nil {
				return nil, err
			}
			b.SubscribeInitialize = true
			return b, nil
		},
	})
}
