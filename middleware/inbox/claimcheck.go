package inbox

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ProducerTimeReader returns when the producer created msg (ok false when msg carries no
// producer time; err for one that is present but unreadable). Config.ProducerTime takes one.
// It must return the same time for every copy of a message, producer retries included: set
// once when the event is created, like its ID. It is the same type as ProducerTimeFunc, so one
// extractor (ProducerTimeFromUUIDv7, ProducerTimeFromMetadata) serves both Config.ProducerTime
// and TooOldGuard.ProducerTime; give both the same one, so that a message too old for its
// partition to exist any more is dead-lettered as too old rather than refused by the claim.
type ProducerTimeReader = ProducerTimeFunc

// ClaimChecker is an optional capability of a Store whose layout accepts only some keys or
// needs more than the key: pgstore's compact layout stores message IDs as the uuid type, and
// its partitioned mode files each claim under the message's producer time. The inbox calls
// CheckClaim before anything is claimed; a refusal makes the message's key invalid (an
// *InvalidKeyError, permanent: dead-lettered with a dead-letter topic, counted by the
// InvalidKeyBrake, which nacks a flood of them as a configuration fault).
type ClaimChecker interface {
	// CheckClaim returns nil when the store can claim p (p.Key set, p.ProducerTime as
	// Config.ProducerTime read it), or an error whose text says why not, without the key.
	CheckClaim(p ClaimParams) error
	// NeedsProducerTime reports whether claims must carry ClaimParams.ProducerTime: New then
	// refuses a Config without ProducerTime.
	NeedsProducerTime() bool
}

// checkClaim reads the producer time into p (when configured) and asks a ClaimChecker store
// whether it can claim key. It returns nil or an *InvalidKeyError.
func (i *Inbox) checkClaim(msg *message.Message, source, key string, p *ClaimParams) error {
	if i.cfg.ProducerTime != nil {
		t, ok, err := i.cfg.ProducerTime(msg)
		if err != nil {
			return &InvalidKeyError{Source: source, Reason: "unreadable producer time: " + err.Error(), Length: len(key)}
		}
		if ok {
			p.ProducerTime = t
		}
	}
	cc, ok := i.cfg.Store.(ClaimChecker)
	if !ok {
		return nil
	}
	q := *p
	q.Key = Key{MessageID: key, ConsumerName: i.cfg.ConsumerName}
	if err := cc.CheckClaim(q); err != nil {
		return &InvalidKeyError{Source: source, Reason: err.Error(), Length: len(key)}
	}
	return nil
}

// errNoProducerTime is returned by Validate for a store that needs producer times and a
// Config without ProducerTime.
var errNoProducerTime = errors.New("the Store files claims by producer time (a partitioned inbox table) but Config.ProducerTime is nil")

func validateProducerTime(c Config) error {
	if cc, ok := c.Store.(ClaimChecker); ok && cc.NeedsProducerTime() && c.ProducerTime == nil {
		return fmt.Errorf("%w: %w; set Config.ProducerTime to read a producer-set timestamp from metadata (stable for every copy of a message), or partition the store by the timestamp of UUIDv7 message IDs (pgstore.ProducerTimeFromKey)", ErrInvalidConfig, errNoProducerTime)
	}
	return nil
}
