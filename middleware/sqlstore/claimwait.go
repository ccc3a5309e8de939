package sqlstore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"
)

// errKeyHeld is claimOnce's error when the key's lock was held by a delivery in flight: the
// claim inserted nothing, waited for nothing on the server, rolled back, returned its
// connection and counted nothing. Claim waits in process and tries again (whileHeld). This is
// the flood protection for one key: copies of a message in flight never hold connections
// while they wait, so they cannot starve other keys.
var errKeyHeld = errors.New("sqlstore: the key's lock is held by another delivery")

// Pauses between the tries of a claim whose key is held: the first, doubled after each try
// up to the last, with jitter (half to all of it).
const (
	claimRetryFirstPause = 10 * time.Millisecond
	claimRetryMaxPause   = 500 * time.Millisecond
)

// whileHeld runs try (one claim) until it returns anything but errKeyHeld, pausing in process
// between tries, until ctx ends: then the error wraps ErrClaimInFlight and ctx's error.
func (s *Store) whileHeld(ctx context.Context, try func() error) error {
	start := time.Now()
	pause := claimRetryFirstPause
	for {
		err := try()
		if !errors.Is(err, errKeyHeld) {
			return err
		}
		timer := time.NewTimer(pause/2 + rand.N(pause/2+1))
		select {
		case <-ctx.Done():
			timer.Stop()
			return fmt.Errorf("%w (waited %s): %w", ErrClaimInFlight, time.Since(start).Round(time.Millisecond), ctx.Err())
		case <-timer.C:
		}
		pause = min(pause*2, claimRetryMaxPause)
	}
}
