package inbox

import (
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
)

// placeClaim gives d its store (storeFor) and checks its claim there (checkClaim). It
// returns nil, a *RouteError or an *InvalidKeyError.
func (i *Inbox) placeClaim(msg *message.Message, source string, d *delivery) error {
	s, route, err := i.storeFor(msg)
	if err != nil {
		return err
	}
	d.store, d.res.Route = s, route
	return i.checkClaim(msg, source, s, &d.claim)
}

// checkClaim reads the producer time into d (when configured) and asks the store whether it
// can claim d at all (pgstore's compact layout needs UUID keys, its partitioned mode a
// producer time). It returns nil or an *InvalidKeyError: permanent, dead-lettered with a
// dead-letter topic, counted by the InvalidKeyBrake.
func (i *Inbox) checkClaim(msg *message.Message, source string, s Store, d *contract.Delivery) error {
	if i.cfg.ProducerTime != nil {
		t, ok, err := i.cfg.ProducerTime(msg)
		if err != nil {
			return &InvalidKeyError{Source: source, Reason: "unreadable producer time: " + err.Error(), Length: len(d.Key.MessageID)}
		}
		if ok {
			d.ProducerTime = t
		}
	}
	if err := s.Check(*d); err != nil {
		return &InvalidKeyError{Source: source, Reason: err.Error(), Length: len(d.Key.MessageID)}
	}
	return nil
}
