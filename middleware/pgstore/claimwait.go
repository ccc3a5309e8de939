package pgstore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// errKeyHeld is claimOnce's error when the key's advisory lock was held by a delivery in
// flight: the claim inserted nothing, waited for nothing, rolled back and counted nothing.
// Claim waits in process, without a connection, and tries again (whileHeld). This is the
// flood protection for one key: copies of a message in flight never hold pool connections
// while they wait, so they cannot starve other keys.
var errKeyHeld = errors.New("pgstore: the key's lock is held by another delivery")

// Pauses between the tries of a claim whose key is held by a delivery in flight: the first,
// doubled after each try up to the last, with jitter (half to all of it).
const (
	claimRetryFirstPause = 10 * time.Millisecond
	claimRetryMaxPause   = 500 * time.Millisecond
)

// acquire takes a pool connection; an ended context while waiting is ErrWaitingForConnection.
func (s *Store) acquire(ctx context.Context) (*pgxpool.Conn, error) {
	start := time.Now()
	conn, err := s.pool.Acquire(ctx)
	if err == nil {
		return conn, nil
	}
	if ctx.Err() != nil {
		st := s.pool.Stat()
		return nil, fmt.Errorf("%w: waited %s, %d of %d connections in use: %w", ErrWaitingForConnection,
			time.Since(start).Round(time.Millisecond), st.AcquiredConns(), st.MaxConns(), err)
	}
	return nil, fmt.Errorf("acquire a connection: %w", err)
}

// whileHeld runs try (one claim) until it returns anything but a key held by a delivery in
// flight (errKeyHeld), pausing in process between tries (claimRetryFirstPause, doubled up to
// claimRetryMaxPause, with jitter), until ctx ends: then the error wraps ErrClaimInFlight
// (claimInFlight). With LockTimeout set, the wait also ends past LockTimeout, as a wait on the
// server would (ErrClaimInFlight, saying so).
func (s *Store) whileHeld(ctx context.Context, try func() error) error {
	start := time.Now()
	pause := claimRetryFirstPause
	var bound time.Time
	if s.cfg.LockTimeout > 0 {
		bound = start.Add(s.cfg.LockTimeout)
	}
	var lockErr error // the last try's errKeyHeld
	for {
		err := try()
		if err != nil && lockErr != nil && !errors.Is(err, errKeyHeld) && ctx.Err() != nil {
			// The context ended during a try after a lock wait (in acquire, or while the
			// claim statement waited): still a key held by a delivery in flight.
			return claimInFlight(ctx, start, lockErr, err)
		}
		if err == nil || !errors.Is(err, errKeyHeld) {
			return err
		}
		lockErr = err
		wait := pause/2 + rand.N(pause/2+1)
		if !bound.IsZero() {
			left := time.Until(bound)
			if left <= 0 {
				return fmt.Errorf("%w (waited %s, past LockTimeout %s): %w", ErrClaimInFlight,
					time.Since(start).Round(time.Millisecond), s.cfg.LockTimeout, lockErr)
			}
			wait = min(wait, left)
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			timer.Stop()
			return claimInFlight(ctx, start, lockErr, nil)
		case <-timer.C:
		}
		pause = min(pause*2, claimRetryMaxPause)
	}
}

// claimInFlight is the error of a claim whose key stayed held by a delivery in flight until
// ctx ended: ErrClaimInFlight, ctx's error, the last lock wait's error (55P03) and, when the
// context ended during a later try, that try's error.
func claimInFlight(ctx context.Context, start time.Time, lockErr, last error) error {
	waited := time.Since(start).Round(time.Millisecond)
	if last == nil {
		return fmt.Errorf("%w (waited %s): %w (last try: %w)", ErrClaimInFlight, waited, ctx.Err(), lockErr)
	}
	return fmt.Errorf("%w (waited %s): %w (last lock wait: %w; last try: %w)", ErrClaimInFlight, waited, ctx.Err(), lockErr, last)
}
