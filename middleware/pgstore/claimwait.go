package pgstore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// DefaultClaimLockTimeout is the lock_timeout of the statements that still wait on a lock
// under the default ClaimLockTimeout (zero): a counted batch's session locks on its keys, and
// a count-first delivery's session lock on its key. A claim that meets a lock of its key for longer gives its
// connection back and waits in process. It is also a sensible positive ClaimLockTimeout.
const DefaultClaimLockTimeout = 2 * time.Millisecond

// errKeyHeld is claimOnce's error when, with the tried lock (ClaimLockTimeout zero), the key's
// advisory lock was held by a delivery in flight: the claim inserted nothing, waited for
// nothing, rolled back and counted nothing. claim waits in process and tries again, as after
// a lock wait past ClaimLockTimeout (55P03).
var errKeyHeld = errors.New("pgstore: the key's lock is held by another delivery")

// tryLock reports whether single claims try the key's advisory lock instead of waiting on a
// lock under a short lock_timeout: ClaimLockTimeout zero, the default (buildClaims,
// tryClaimSQL).
func (s *Store) tryLock() bool { return s.cfg.ClaimLockTimeout == 0 }

// keyBusy reports a claim error that means the key was held by a delivery in flight: the
// tried lock was taken (errKeyHeld), or a lock wait passed the claim's lock_timeout (55P03).
func keyBusy(err error) bool { return errors.Is(err, errKeyHeld) || isLockNotAvailable(err) }

// savedLockTimeout is the custom setting that holds the claim transaction's own lock_timeout
// while the claim runs under ClaimLockTimeout.
const savedLockTimeout = "watermill_inbox.lock_timeout"

// SQLStateLockNotAvailable is lock_not_available (class 55), raised when a lock wait passes
// lock_timeout.
const SQLStateLockNotAvailable = "55P03"

// Pauses between the tries of a claim whose key is held by a delivery in flight: the first,
// doubled after each try up to the last, with jitter (half to all of it).
const (
	claimRetryFirstPause = 10 * time.Millisecond
	claimRetryMaxPause   = 500 * time.Millisecond
)

// ErrClaimInFlight is wrapped by a claim's error when its key stayed claimed by another
// delivery (an uncommitted claim, or the key's attempt lock held by a counted delivery) until
// the claim's context ended (the inbox's ClaimTimeout). The claim held no pool connection while it waited, and
// counted nothing: the inbox nacks it without using up an attempt, and the redelivery is a
// duplicate once the delivery in flight commits. The error also wraps the context's error and
// the last try's error: with a positive ClaimLockTimeout, the lock wait's *pgconn.PgError
// (SQLSTATE 55P03); with the default tried lock, an error saying the key's lock was held.
var ErrClaimInFlight = errors.New("pgstore: the key is claimed by a delivery in flight")

// ErrWaitingForConnection is wrapped by a claim's error when its context ended while it
// waited for a pool connection (every connection in use: size pgxpool's pool_max_conns to the
// subscriber's concurrency plus a few). The error also wraps the context's error and says
// how long it waited and how many connections the pool has.
var ErrWaitingForConnection = errors.New("pgstore: waiting for a pool connection")

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

// claimLockTimeout is the lock_timeout of the claim's statements (DefaultClaimLockTimeout for
// a zero ClaimLockTimeout), or 0 to leave lock_timeout as it is: a negative ClaimLockTimeout,
// or a LockTimeout set (which already bounds how long a
// claim holds its connection while it waits: past it the claim fails with 55P03).
func (s *Store) claimLockTimeout() time.Duration {
	switch {
	case s.cfg.ClaimLockTimeout < 0 || s.cfg.LockTimeout > 0:
		return 0
	case s.cfg.ClaimLockTimeout == 0:
		return DefaultClaimLockTimeout
	}
	return s.cfg.ClaimLockTimeout
}

// lockWait is the lock_timeout of the claim's statements that wait on a key's lock (a
// count-first delivery's session lock, a counted batch's locks, the waiting claim forms), or 0
// to leave lock_timeout as it is. Under the tried lock (ClaimLockTimeout zero) it is
// DefaultClaimLockTimeout even with LockTimeout set: those waits then give the connection
// back as the tried claims do, and whileHeld bounds the whole in-process wait by LockTimeout.
// Otherwise it is claimLockTimeout.
func (s *Store) lockWait() time.Duration {
	if s.tryLock() {
		return DefaultClaimLockTimeout
	}
	return s.claimLockTimeout()
}

// queueClaimLockTimeout queues the claim's lock_timeout. In the claim transaction (restore)
// the transaction's own value is saved first, and queueRestoreLockTimeout puts it back after
// the claim, so the handler's statements run under LockTimeout or the server's setting.
func (s *Store) queueClaimLockTimeout(b *pgx.Batch, restore bool) {
	d := s.lockWait()
	if d == 0 {
		return
	}
	if restore {
		// One statement: the subquery (not pulled up: set_config is volatile) saves the
		// transaction's value before the outer set_config replaces it.
		b.Queue("select set_config('lock_timeout', $1, true) from (select set_config('"+savedLockTimeout+"', current_setting('lock_timeout'), true)) saved", millis(d))
		return
	}
	b.Queue("select set_config('lock_timeout', $1, true)", millis(d))
}

// queueRestoreLockTimeout queues the restore of the lock_timeout saved by
// queueClaimLockTimeout.
func (s *Store) queueRestoreLockTimeout(b *pgx.Batch) {
	if s.lockWait() == 0 {
		return
	}
	b.Queue("select set_config('lock_timeout', current_setting('" + savedLockTimeout + "'), true)")
}

// isLockNotAvailable reports SQLSTATE 55P03.
func isLockNotAvailable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == SQLStateLockNotAvailable
}

// claim runs claimOnce; when its key is held by a delivery in flight (the key's lock tried and
// taken, errKeyHeld; or a lock wait past a positive ClaimLockTimeout, SQLSTATE 55P03),
// claimOnce has rolled back, taken back any count and released its connection, and claim
// waits without a connection, then tries again: until it claims or finds a duplicate, or ctx
// ends; then the error wraps ErrClaimInFlight. With a negative ClaimLockTimeout, or a
// positive one and LockTimeout set, the claim waits on the server once.
func (s *Store) claim(ctx context.Context, p inbox.CountedClaimParams, counted bool) (*claimTx, inbox.CountedClaimResult, error) {
	if !s.tryLock() && s.claimLockTimeout() == 0 {
		return s.claimOnce(ctx, p, counted)
	}
	var t *claimTx
	var res inbox.CountedClaimResult
	err := s.whileHeld(ctx, func() (err error) {
		t, res, err = s.claimOnce(ctx, p, counted)
		return err
	})
	if err != nil {
		return nil, inbox.CountedClaimResult{}, err
	}
	return t, res, nil
}

// whileHeld runs try (one claim, single or batch) until it returns anything but a key held by
// a delivery in flight (keyBusy), pausing in process between tries (claimRetryFirstPause,
// doubled up to claimRetryMaxPause, with jitter), until ctx ends: then the error wraps
// ErrClaimInFlight (claimInFlight). With the tried lock and LockTimeout set, the in-process
// wait ends past LockTimeout too, as a wait on the server would (ErrClaimInFlight, saying so).
func (s *Store) whileHeld(ctx context.Context, try func() error) error {
	start := time.Now()
	pause := claimRetryFirstPause
	var bound time.Time
	if s.tryLock() && s.cfg.LockTimeout > 0 {
		bound = start.Add(s.cfg.LockTimeout)
	}
	var lockErr error // the last try's errKeyHeld or 55P03
	for {
		err := try()
		if err != nil && lockErr != nil && !keyBusy(err) && ctx.Err() != nil {
			// The context ended during a try after a lock wait (in acquire, or while the
			// claim statement waited): still a key held by a delivery in flight.
			return claimInFlight(ctx, start, lockErr, err)
		}
		if err == nil || !keyBusy(err) {
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
