package kafka

import (
	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-inbox/watermill-inbox/adapters"
)

// Importing the package registers the "kafka" broker: Spec.URL is the bootstrap brokers
// (ParseBrokers: "k1:9092,k2:9092", optionally behind kafka://; required, no local default),
// Spec.Settings a Config (or *Config) or nil.
func init() {
	adapters.Register(Name, adapters.Driver{
		ValidateURL: func(url string) error { _, err := ParseBrokers(url); return err },
		Open: func(spec adapters.Spec, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
			brokers, err := ParseBrokers(spec.URL)
			if err != nil {
				return nil, err
			}
			c, err := adapters.SettingsAs[Config](Name, spec.Settings)
			if err != nil {
				return nil, err
			}
			c.Brokers, c.ConsumerGroup = brokers, spec.ConsumerGroup
			return New(c, logger)
		},
	})
}
