package inboxmetrics

import (
	"errors"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Defaults of Options.MaxConsumers and Options.MaxTopics.
const (
	// DefaultMaxConsumers bounds the consumer names that get series of their own. Each
	// consumer name costs up to about 70 series per topic (7 outcomes, 5 counters, 3
	// histograms of 16 buckets), so 100 names on 5 topics stay near 35,000 series.
	DefaultMaxConsumers = 100
	// DefaultMaxTopics bounds the topics (subscribed topics and the relay's destination
	// topics) that get series of their own.
	DefaultMaxTopics = 100
)

// Other is the label value that stands for every consumer name or topic past the bound
// (Options.MaxConsumers, Options.MaxTopics): their deliveries are counted there, so sums over
// the label stay exact. Observer refuses it as a consumer name.
const Other = "_other"

// ErrReservedConsumer is returned by Observer for the consumer name Other.
var ErrReservedConsumer = errors.New("inboxmetrics: consumer name " + Other + " is reserved")

// bounded hands out label values: the first max distinct values as they are, every later
// one as Other. It is safe for concurrent use.
type bounded struct {
	max     int
	reached prometheus.Gauge // set to 1 at the first fold
	mu      sync.RWMutex
	seen    map[string]struct{}
}

func newBounded(max int, reached prometheus.Gauge) *bounded {
	reached.Set(0)
	return &bounded{max: max, reached: reached, seen: make(map[string]struct{})}
}

// label returns v, or Other when max other values are taken already.
func (b *bounded) label(v string) string {
	b.mu.RLock()
	_, ok := b.seen[v]
	b.mu.RUnlock()
	if ok {
		return v
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.seen[v]; ok {
		return v
	}
	if len(b.seen) >= b.max {
		b.reached.Set(1)
		return Other
	}
	b.seen[v] = struct{}{}
	return v
}

// validateConsumer refuses what inbox.New refuses as a consumer name
// (inbox.ValidateConsumerName), and Other.
func validateConsumer(name string) error {
	if err := inbox.ValidateConsumerName(name); err != nil {
		return err
	}
	if name == Other {
		return ErrReservedConsumer
	}
	return nil
}
