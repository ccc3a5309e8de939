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

// DefaultClaimLockTimeout is Config.ClaimLockTimeout's default: a claim that meets a lock of
// its key for longer gives its connection back and waits in process.
const DefaultClaimLockTimeout = 2 * time.Millisecond

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
// the last lock wait's *pgconn.PgError (SQLSTATE 55P03).
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

// queueClaimLockTimeout queues the claim's lock_timeout. In the claim transaction (restore)
// the transaction's own value is saved first, and queueRestoreLockTimeout puts it back after
// the claim, so the handler's statements run under LockTimeout or the server's setting.
func (s *Store) queueClaimLockTimeout(b *pgx.Batch, restore bool) {
	d := s.claimLockTimeout()
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
	if s.claimLockTimeout() == 0 {
		return
	}
	b.Queue("select set_config('lock_timeout', current_setting('" + savedLockTimeout + "'), true)")
}

// isLockNotAvailable reports SQLSTATE 55P03.
func isLockNotAvailable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == SQLStateLockNotAvailable
}

// claim runs claimOnce; when its key is held by a delivery in flight (a lock wait past the
// claim's short lock_timeout, SQLSTATE 55P03), claimOnce has rolled back, taken back any
// count and released its connection, and claim waits without a connection, then tries again:
// until it claims or finds a duplicate, or ctx ends; then the error wraps ErrClaimInFlight.
// With LockTimeout set, or a negative ClaimLockTimeout, the claim waits on the server once.
func (s *Store) claim(ctx context.Context, p inbox.CountedClaimParams, counted bool) (*claimTx, inbox.CountedClaimResult, error) {
	if s.claimLockTimeout() == 0 {
		return s.claimOnce(ctx, p, counted)
	}
	start := time.Now()
	pause := claimRetryFirstPause
	var lockErr error // the last try's 55P03
	for {
		t, res, err := s.claimOnce(ctx, p, counted)
		if err != nil && lockErr != nil && !isLockNotAvailable(err) && ctx.Err() != nil {
			// The context ended during a try after a lock wait (in acquire, or while the
			// claim statement waited): still a key held by a delivery in flight.
			return nil, inbox.CountedClaimResult{}, claimInFlight(ctx, start, lockErr, err)
		}
		if err == nil || !isLockNotAvailable(err) {
			return t, res, err
		}
		lockErr = err
		timer := time.NewTimer(pause/2 + rand.N(pause/2+1))
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil, inbox.CountedClaimResult{}, claimInFlight(ctx, start, lockErr, nil)
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
