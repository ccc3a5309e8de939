package pgstore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/pgtx"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Check reports whether the store can claim d: with LayoutCompact the key must be a canonical
// lowercase UUID (ErrKeyNotUUID); partitioned with ProducerTimeFromKey it must be a UUIDv7
// (ErrKeyNotUUIDv7); with ProducerTimeFromClaim, d.ProducerTime must be set
// (ErrNoProducerTime). Errors also wrap inbox.ErrInvalidKey. Nil for the text layout.
func (s *Store) Check(d contract.Delivery) error {
	_, err := s.period(d)
	return err
}

// NeedsProducerTime reports whether claims must carry a producer time: partitioned with
// ProducerTimeFromClaim (inbox.Config.ProducerTime is then required).
func (s *Store) NeedsProducerTime() bool {
	return s.cfg.Partitioning != nil && s.cfg.Partitioning.ProducerTime == ProducerTimeFromClaim
}

// Claim claims d.Key for the inbox and decides (contract.Decide). Everything before the
// handler travels in one pipelined round trip:
//
//	BEGIN ISOLATION LEVEL ...; [the local timeouts;] queries/claim.sql; [queries/record.sql]
//
// The attempt record is read only with attempt counting (a dead-letter topic), which also
// takes the key's lock for the session (released in COMMIT's round trip, or once a failure is
// recorded). A delivery that counts first (d.CountFirst) is counted in the same round trip,
// by a transaction of its own ahead of the claim's (claimBatch, queries/count_first.sql). A
// duplicate costs one more round trip (queries/stored_hash.sql, ROLLBACK, and with counting
// queries/clear_processed.sql). A key whose lock a delivery in flight holds is waited for in
// process, without a connection, until ctx ends (ErrClaimInFlight). On error nothing is left
// open, no lock held and nothing counted.
func (s *Store) Claim(ctx context.Context, d contract.Delivery) (contract.Tx, contract.Claim, error) {
	var t *claimTx
	var c contract.Claim
	err := s.whileHeld(ctx, func() (err error) {
		t, c, err = s.claimOnce(ctx, d)
		return err
	})
	if err != nil || t == nil {
		return nil, c, err
	}
	return t, c, nil
}

// claimOnce is one try of Claim; errKeyHeld means the key's lock was held.
func (s *Store) claimOnce(ctx context.Context, d contract.Delivery) (*claimTx, contract.Claim, error) {
	lvl, err := isoLevel(d.Isolation)
	if err != nil {
		return nil, contract.Claim{}, err
	}
	period, err := s.period(d)
	if err != nil {
		return nil, contract.Claim{}, err
	}
	if err := s.registerConsumer(ctx, d.Key.ConsumerName); err != nil {
		return nil, contract.Claim{}, err
	}
	conn, err := s.acquire(ctx)
	if err != nil {
		return nil, contract.Claim{}, err
	}
	t := &claimTx{s: s, conn: conn, key: d.Key, period: period, finish: finishTimeout(d.FinishTimeout), counting: d.MaxAttempts > 0}
	t.lockKey = s.lockKey(d.Key)
	b, ans := s.claimBatch(t, d, lvl)
	err = s.sendClaim(ctx, conn, b, t)
	first, claimed := ans.first, ans.claimed
	t.counted = first.committed && first.counted
	t.session = t.counted || (t.trySession && !t.countSent && claimed)
	if err != nil {
		return nil, contract.Claim{}, s.failedClaim(ctx, t, first, err)
	}
	if ans.preLock && claimed && !ans.locked {
		// The key's lock was held when tried ahead of the claim, and released before the
		// claim tried it: claim again, with a snapshot later than the lock.
		t.session = false
		_ = t.end(ctx, t.rollback)
		return nil, contract.Claim{}, errKeyHeld
	}
	if d.CountFirst && t.counting && !t.counted {
		return t.notCounted(ctx, d, claimed)
	}
	return t.decide(ctx, d, lvl, ans)
}

// decide turns what a claimed (or duplicate) round trip answered into the decision, ending t
// unless it is Run.
func (t *claimTx) decide(ctx context.Context, d contract.Delivery, lvl pgx.TxIsoLevel, ans *claimAnswers) (*claimTx, contract.Claim, error) {
	if !ans.claimed {
		stored, at, err := t.endDuplicate(ctx)
		if err != nil {
			return nil, contract.Claim{}, err
		}
		c := contract.Decide(d, false, stored, contract.Record{})
		c.StoredAt = at
		return nil, c, nil
	}
	rec := ans.rec
	if d.CountFirst && t.counting {
		rec = ans.first.rec
	}
	rec.Counted = t.counted
	c := contract.Decide(d, true, nil, rec)
	if c.Decision != contract.Run {
		// Not run after all (dead-lettered, exhausted, to run alone): nothing of this try is
		// kept, and its count is taken back while the key's session lock is held.
		if err := t.end(ctx, func(ctx context.Context) error {
			err := t.rollback(ctx)
			t.takeBack(ctx)
			return err
		}); err != nil {
			return nil, contract.Claim{}, fmt.Errorf("pgstore: claim: roll back: %w", err)
		}
		return nil, c, nil
	}
	t.attempts = c.Attempts + b2i(t.counted)
	// Commit clears the key's attempt record when it may have one: one was read, this
	// delivery counted, or the snapshot could have missed one.
	t.dirty = t.counting && !d.CountFirst && (rec.Attempts > 0 || rec.LastError != "" || lvl != pgx.ReadCommitted)
	t.iso = lvl
	t.h = &handlerTx{Tx: t.tx}
	return t, c, nil
}

// claimAnswers are what the claim's round trip answered.
type claimAnswers struct {
	preLock bool // the key's session lock was tried ahead of the claim's transaction
	locked  bool // and taken
	first   countFirstResult
	claimed bool            // the claim inserted the key
	rec     contract.Record // the key's attempt record (counting, not counted first)
}

// claimBatch is the claim's round trip for d, whose answers go to the returned claimAnswers:
//
//	BEGIN ISOLATION LEVEL ...; [the local timeouts;] queries/claim.sql; [queries/record.sql]
//
// and for a delivery that counts first, the count's own transaction ahead of it, and the
// clean-up of its count inside the claim's:
//
//	BEGIN; SET LOCAL synchronous_commit = off; queries/count_first.sql; COMMIT;
//	BEGIN ISOLATION LEVEL ...; [the local timeouts;] queries/claim.sql; queries/clear_counted.sql
func (s *Store) claimBatch(t *claimTx, d contract.Delivery, lvl pgx.TxIsoLevel) (*pgx.Batch, *claimAnswers) {
	ans := &claimAnswers{}
	b := &pgx.Batch{}
	countFirst := t.counting && d.CountFirst
	// Counting under REPEATABLE READ or SERIALIZABLE without a count first: the key's lock is
	// taken for the session in a READ COMMITTED transaction of its own ahead of the claim's,
	// as count_first.sql takes it, so that the claim's snapshot, taken at its first statement,
	// is later than the lock: a snapshot taken before it could miss the attempt record a
	// delivery that held the key committed just before releasing it.
	ans.preLock = t.counting && !countFirst && lvl != pgx.ReadCommitted
	switch {
	case ans.preLock:
		b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
		t.trySession = true
		b.Queue(s.q.lockSession.sql, s.q.lockSession.args(&queryArgs{lockKey: t.lockKey})...).QueryRow(func(row pgx.Row) error {
			return row.Scan(&ans.locked)
		})
		b.Queue("commit")
		b.Queue(beginSQL(lvl))
	case countFirst:
		b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
		b.Queue("set local synchronous_commit = off")
		a := s.claimArgs(d, t.period)
		a.countToken = rand.Int64()
		t.countToken, t.countSent, t.trySession = a.countToken, true, true
		b.Queue(s.q.countFirst.sql, s.q.countFirst.args(a)...).QueryRow(ans.first.scan)
		b.Queue("commit").Exec(func(pgconn.CommandTag) error { ans.first.committed = true; return nil })
		b.Queue(beginSQL(lvl))
	default:
		b.BeginTx(pgx.TxOptions{IsoLevel: lvl})
	}
	s.queueTimeouts(b)
	claimQ := s.q.claim
	if t.counting && !countFirst && !ans.preLock {
		// Counting without a count first: the key's lock for the session (claim.sql).
		claimQ, t.trySession = s.q.claimSession, true
	}
	b.Queue(claimQ.sql, claimQ.args(s.claimArgs(d, t.period))...).Exec(func(ct pgconn.CommandTag) error {
		ans.claimed = ct.RowsAffected() == 1
		return nil
	})
	switch {
	case countFirst:
		a := keyArgs(d.Key, t.period)
		a.countToken = t.countToken
		b.Queue(s.q.clearCounted.sql, s.q.clearCounted.args(a)...)
	case t.counting:
		b.Queue(s.q.record.sql, s.q.record.args(keyArgs(d.Key, t.period))...).QueryRow(func(row pgx.Row) error {
			return scanRecord(row, &ans.rec)
		})
	}
	return b, ans
}

// failedClaim ends t after its round trip failed with err, leaving nothing open and nothing
// counted: a count whose answer arrived is taken back on the connection, one that may have
// committed unseen (the answer was lost with the connection) by its token. It returns err,
// wrapped.
func (s *Store) failedClaim(ctx context.Context, t *claimTx, first countFirstResult, err error) error {
	lost := t.countSent && t.conn.Conn().IsClosed() && !(first.answered && !first.counted)
	pid := t.conn.Conn().PgConn().PID()
	_ = t.end(ctx, func(ctx context.Context) error {
		_, _ = t.conn.Exec(ctx, "rollback")
		t.takeBack(ctx)
		if t.trySession && !t.session {
			// The count or the claim may have taken the key's session lock without its
			// answer saying so (it failed after taking it, on a lock or statement timeout),
			// or the count counted nothing with it (a dead-lettered key) before the claim
			// failed: release it if held.
			t.unlockIfHeld(ctx)
		}
		return nil
	})
	if lost {
		if lerr := s.takeBackLost(ctx, t, pid); lerr != nil {
			err = errors.Join(err, lerr)
		}
	}
	return fmt.Errorf("pgstore: claim: %w", s.wrapNoPartition(err, t.period))
}

// unlockIfHeld releases the key's session lock if t's session holds it
// (queries/unlock_if_held.sql); a connection that cannot say is closed, so the lock cannot
// outlive the delivery.
func (t *claimTx) unlockIfHeld(ctx context.Context) {
	if t.conn.Conn().IsClosed() {
		return
	}
	q := t.s.q.unlockIfHeld
	if _, err := t.conn.Exec(ctx, q.sql, q.args(&queryArgs{lockKey: t.lockKey})...); err != nil {
		_ = t.conn.Conn().Close(ctx)
	}
}

// countFirstResult is what queries/count_first.sql answered.
type countFirstResult struct {
	answered  bool            // the count statement's answer arrived
	counted   bool            // one attempt was counted (and the key's session lock taken)
	committed bool            // the count's transaction committed
	rec       contract.Record // the key's record after the count
}

func (r *countFirstResult) scan(row pgx.Row) error {
	var attempts int32
	var lastError *string
	err := row.Scan(&attempts, &lastError)
	r.answered = err == nil || errors.Is(err, pgx.ErrNoRows)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	r.counted, r.rec.Attempts = err == nil, int(attempts)
	if lastError != nil {
		r.rec.LastError = *lastError
	}
	return err
}

// notCounted ends a claim whose count_first.sql counted nothing, in one round trip: the
// stored payload hash, ROLLBACK, the key's session lock released if this session took it
// (queries/unlock_if_held.sql), the key's record and, for a claim that inserted nothing, the
// duplicate's age (queries/duplicate_age.sql). A stored row is a duplicate; a lock taken
// means the key is dead-lettered (contract.Decide says so from the record); any other case is
// a key held by a delivery in flight (errKeyHeld), including a claim that took the key's lock
// after its count found it held: it is claimed again, to be counted before its handler.
func (t *claimTx) notCounted(ctx context.Context, d contract.Delivery, claimed bool) (*claimTx, contract.Claim, error) {
	s := t.s
	var stored []byte
	var at time.Time
	held := false
	var rec contract.Record
	a := keyArgs(t.key, t.period)
	err := t.end(ctx, func(ctx context.Context) error {
		b := &pgx.Batch{}
		if !claimed {
			b.Queue(s.q.storedHash.sql, s.q.storedHash.args(a)...).QueryRow(func(row pgx.Row) error {
				if err := s.scanHash(row, &stored, &at); !errors.Is(err, pgx.ErrNoRows) {
					return err
				}
				return nil
			})
		}
		b.Queue("rollback")
		b.Queue(s.q.unlockIfHeld.sql, s.q.unlockIfHeld.args(&queryArgs{lockKey: t.lockKey})...).QueryRow(func(row pgx.Row) error {
			return row.Scan(&held)
		})
		b.Queue(s.q.record.sql, s.q.record.args(a)...).QueryRow(func(row pgx.Row) error {
			return scanRecord(row, &rec)
		})
		if !claimed {
			// A duplicate's age, as endDuplicate adds it (nothing without a stored row).
			b.Queue(s.q.duplicateAge.sql, s.q.duplicateAge.args(a)...)
		}
		if err := t.conn.Conn().SendBatch(ctx, b).Close(); err != nil {
			// The key's session lock may be left with the connection: close it.
			_ = t.conn.Conn().Close(ctx)
			return fmt.Errorf("pgstore: claim: %w", err)
		}
		return nil
	})
	switch {
	case err != nil:
		return nil, contract.Claim{}, err
	case stored != nil:
		c := contract.Decide(d, false, stored, contract.Record{})
		c.StoredAt = at
		return nil, c, nil
	case claimed && held && rec.DeadLettered:
		return nil, contract.Decide(d, true, nil, rec), nil
	}
	return nil, contract.Claim{}, errKeyHeld
}

// takeBack takes back this delivery's count on the claim's own connection, once its
// transaction has ended and while it holds the key's session lock (no copy counts meanwhile).
// A count that cannot be taken back (the connection is gone, and the lock with it) stays: the
// message has one attempt more than its handler runs (docs/design.md).
func (t *claimTx) takeBack(ctx context.Context) {
	if !t.counted || !t.session || t.conn.Conn().IsClosed() {
		return
	}
	if _, err := t.s.record(ctx, t.conn, t.key, t.period, -1, ""); err == nil {
		t.counted, t.countSent = false, false
	}
}

// takeBackLost takes back the count of t's claim whose answer was lost with its connection:
// it ends the server process that ran the claim's round trip (pg_terminate_backend, waiting up
// to the finish timeout), so the count can no longer commit after this, then takes it back by
// its token (queries/take_back_lost.sql) on a pool connection. pid is the process's. A copy that counted since then
// changed the token: its count is left, and this one stays too (one attempt more than the
// handler's runs, the cost of a crash at the same point).
func (s *Store) takeBackLost(ctx context.Context, t *claimTx, pid uint32) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.finish)
	defer cancel()
	if _, err := s.pool.Exec(ctx, "SELECT pg_terminate_backend($1, $2)", int32(pid), t.finish.Milliseconds()); err != nil {
		return fmt.Errorf("pgstore: end the server process of a lost claim: %w", err)
	}
	a := keyArgs(t.key, t.period)
	a.countToken = t.countToken
	q := s.q.takeBackLost
	if _, err := s.pool.Exec(ctx, q.sql, q.args(a)...); err != nil {
		return fmt.Errorf("pgstore: take back a lost count: %w", err)
	}
	return nil
}

// beginSQL is BEGIN at isolation level lvl.
func beginSQL(lvl pgx.TxIsoLevel) string {
	return "begin isolation level " + strings.ToLower(string(lvl))
}

// endDuplicate ends the transaction of a claim that inserted nothing, in one round trip: it
// reads the stored payload hash, rolls back, with counting deletes the key's stale attempt
// record (the key is processed), and adds the stored row's age to the consumer's duplicate-age
// histogram (queries/duplicate_age.sql; the two commit asynchronously). No stored row means the
// key's lock was held by a delivery in flight: errKeyHeld, and the record and the histogram are
// left alone (both statements check the row).
func (t *claimTx) endDuplicate(ctx context.Context) ([]byte, time.Time, error) {
	s := t.s
	var stored []byte
	var at time.Time
	held := false
	err := t.end(ctx, func(ctx context.Context) error {
		b := &pgx.Batch{}
		b.Queue(s.q.storedHash.sql, s.q.storedHash.args(keyArgs(t.key, t.period))...).QueryRow(func(row pgx.Row) error {
			err := s.scanHash(row, &stored, &at)
			if errors.Is(err, pgx.ErrNoRows) {
				held = true
				return nil
			}
			return err
		})
		b.Queue("rollback")
		unlock := t.trySession && !t.session
		if unlock {
			// The claim may have taken the key's session lock and found the key stored.
			b.Queue(s.q.unlockIfHeld.sql, s.q.unlockIfHeld.args(&queryArgs{lockKey: t.lockKey})...)
		}
		if t.counting {
			b.Queue(s.q.clearProcessed.sql, s.q.clearProcessed.args(keyArgs(t.key, t.period))...)
		}
		b.Queue(s.q.duplicateAge.sql, s.q.duplicateAge.args(keyArgs(t.key, t.period))...)
		if err := t.conn.Conn().SendBatch(ctx, b).Close(); err != nil {
			_, _ = t.conn.Exec(ctx, "rollback")
			t.takeBack(ctx)
			if unlock {
				t.unlockIfHeld(ctx)
			}
			return fmt.Errorf("pgstore: claim: read stored payload hash: %w", err)
		}
		if held {
			t.takeBack(ctx)
		}
		return nil
	})
	if err != nil {
		return nil, time.Time{}, err
	}
	if held {
		return nil, time.Time{}, errKeyHeld
	}
	return stored, at, nil
}

func scanRecord(row pgx.Row, rec *contract.Record) error {
	var attempts int32
	var lastError *string
	err := row.Scan(&attempts, &lastError, &rec.DeadLettered)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	rec.Attempts = int(attempts)
	if lastError != nil {
		rec.LastError = *lastError
	}
	return err
}

// claimArgs are the claim statement's parameters for d.
func (s *Store) claimArgs(d contract.Delivery, period time.Time) *queryArgs {
	a := keyArgs(d.Key, period)
	a.messageType, a.correlationID = nullIfEmpty(d.MessageType), nullIfEmpty(d.CorrelationID)
	a.payloadHash = s.hashArg(d.PayloadHash)
	a.lockKey = s.lockKey(d.Key)
	return a
}

// lockKey is the text hashed (hashtextextended) into the key's advisory lock: table, consumer
// name and message ID, separated by a unit separator. Two keys that hash alike only share a
// lock, which makes one of them wait in process while the other is in flight.
func (s *Store) lockKey(k inbox.Key) string {
	return s.table + "\x1f" + k.ConsumerName + "\x1f" + k.MessageID
}

func finishTimeout(d time.Duration) time.Duration {
	if d <= 0 {
		return inbox.DefaultFinishTimeout
	}
	return d
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// sendClaim runs the claim pipeline b on conn. It is sent on a context that ctx's end does not
// break: pgx would close the connection, and with it the knowledge of which statements ran.
// When ctx ends first (the claim timeout, the router shutting down), sendClaim asks the server
// to cancel the statement that runs (PostgreSQL's cancel request; SQLSTATE 57014), so the
// pipeline ends on a healthy connection, and reports ctx's error. Such a connection is closed
// after the delivery ends rather than reused, since a cancel request can arrive late. If the
// server does not answer within the finish timeout after that, the connection is closed.
func (s *Store) sendClaim(ctx context.Context, conn *pgxpool.Conn, b *pgx.Batch, t *claimTx) error {
	var fired atomic.Bool
	sent, done := make(chan struct{}), make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(done)
		fired.Store(true)
		cctx, cancel := context.WithTimeout(context.Background(), t.finish)
		defer cancel()
		// Never touch the PgConn itself here (it is not safe for concurrent use): expire the
		// socket instead, so the claiming goroutine's read fails and pgconn closes it there.
		abort := func() { _ = conn.Conn().PgConn().Conn().SetDeadline(time.Now()) }
		if err := conn.Conn().PgConn().CancelRequest(cctx); err != nil {
			abort()
			return
		}
		select {
		case <-time.After(t.finish):
			abort() // the server did not answer: give up on it
		case <-sent:
		}
	})
	if err := ctx.Err(); err != nil {
		// Ended before anything was sent: a cancel request would find nothing to cancel.
		close(sent)
		if !stop() {
			<-done
		}
		t.poisoned = fired.Load()
		return err
	}
	br := conn.Conn().SendBatch(context.WithoutCancel(ctx), b)
	t.tx = br.Tx()
	err := br.Close()
	close(sent)
	if !stop() {
		<-done // it started: let it finish before anything else runs on conn
	}
	if fired.Load() {
		t.poisoned = true
		if err == nil {
			err = ctx.Err()
		}
		return fmt.Errorf("%w (%w)", ctx.Err(), err)
	}
	return err
}

// claimTx is an open claim transaction on a connection acquired for it; it releases the
// connection once it ends.
type claimTx struct {
	s        *Store
	conn     *pgxpool.Conn
	tx       pgx.Tx
	h        *handlerTx // what the handler is given
	key      inbox.Key
	period   time.Time // the claim's partition period (partitioned mode)
	finish   time.Duration
	counting bool // attempt counting (a dead-letter topic)
	session  bool // holds the key's session-level lock (count_first.sql): end releases it
	lockKey  string
	counted  bool // this delivery was counted before its handler
	// countSent: count_first.sql was sent, marked with countToken.
	countSent bool
	// trySession: the round trip tried the key's session lock (count_first.sql, or claim.sql
	// with .Session).
	trySession bool
	// sessionAll: a counting batch, whose claims may hold their keys' locks for the session:
	// end releases every session-level advisory lock of the connection.
	sessionAll bool
	countToken int64
	attempts   int  // the key's count with this delivery's own, as the claim found it
	dirty      bool // the key may have an attempt record for Commit to clear
	iso        pgx.TxIsoLevel
	poisoned   bool // a cancel request was sent on conn: close it rather than reuse it
	ended      bool
	// commitFailed: Commit ended the transaction without committing (or with an unknown
	// outcome); Fail then records outside it.
	commitFailed bool
}

func (t *claimTx) Context(ctx context.Context) context.Context {
	return pgtx.With(ctx, t.h)
}

// end runs f on a context detached from ctx's cancellation and bounded by the finish timeout,
// then releases the connection (closing it when a cancel request may still arrive on it).
func (t *claimTx) end(ctx context.Context, f func(context.Context) error) error {
	if t.ended {
		return nil
	}
	t.ended = true
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.finish)
	defer cancel()
	err := f(dctx)
	if t.sessionAll && !t.conn.Conn().IsClosed() {
		// A batch's keys, each locked for the session by its claim (claim.sql with .Session).
		if _, uerr := t.conn.Exec(dctx, "SELECT pg_advisory_unlock_all()"); uerr != nil {
			_ = t.conn.Conn().Close(dctx)
		}
		t.sessionAll = false
	}
	if t.session && !t.conn.Conn().IsClosed() {
		// The key's session lock (a delivery counted before its handler), now that the
		// transaction is over; a connection that cannot release it is closed, so the lock
		// cannot outlive the delivery.
		if _, uerr := t.conn.Exec(dctx, t.s.q.unlock.sql, t.s.q.unlock.args(&queryArgs{lockKey: t.lockKey})...); uerr != nil {
			_ = t.conn.Conn().Close(dctx)
		}
		t.session = false
	}
	if t.poisoned {
		_ = t.conn.Conn().Close(dctx)
	}
	t.conn.Release()
	return err
}

// rollback is ROLLBACK alone, in the simple protocol's one message (as pgx's own Tx sends it).
func (t *claimTx) rollback(ctx context.Context) error {
	_, err := t.conn.Conn().PgConn().Exec(ctx, "rollback").ReadAll()
	return err
}

// Commit commits. It first checks, without a round trip, that the transaction is still the
// inbox's and open (ErrTxEnded otherwise: PostgreSQL answers a COMMIT outside a transaction
// with the tag COMMIT and a warning, which would ack a message whose claim is gone). When the
// key may have an attempt record, queries/clear_processed.sql travels with COMMIT, in one
// round trip: under READ COMMITTED before it, inside the transaction (it sees the count made
// after the claim, and commits or rolls back with the claim); under REPEATABLE READ and
// SERIALIZABLE, whose snapshot predates that count, after it, in a transaction of its own that
// commits asynchronously (a crash between the two leaves a stale record of a processed key,
// which the key's next duplicate removes).
//
// An error wraps inbox.ErrCommitRolledBack when the rollback is certain: the handler ended
// the transaction (ErrTxEnded), the server answered ROLLBACK (a statement had failed), or
// COMMIT (or the clean-up before it) raised an error (a *pgconn.PgError, such as a deferred
// constraint's SQLSTATE 23505, or 40001 under SERIALIZABLE). Any other error leaves the
// outcome unknown.
func (t *claimTx) Commit(ctx context.Context) error {
	if t.ended {
		return nil
	}
	if err := t.h.endedOn(t.conn); err != nil {
		if t.committedByHandler(ctx) {
			return nil
		}
		t.commitFailed = true
		_ = t.end(ctx, t.rollback)
		return err
	}
	return t.end(ctx, func(ctx context.Context) error {
		var clear []clearKey
		if t.dirty {
			clear = []clearKey{{t.key, t.period}}
		}
		rel := release{}
		if t.session {
			rel.key = t.lockKey
		}
		err := t.s.commitWith(ctx, t.conn, t.iso, clear, rel)
		if err != nil {
			t.commitFailed = true
		} else if !rel.none() {
			t.session = false // released in COMMIT's round trip
		}
		return err
	})
}

// committedByHandler reports whether a statement of the handler committed the transaction
// (a multi-statement string ending with COMMIT, which handlerTx's guard cannot see): the
// connection is idle and the claim is in the table. The claim and the handler's writes then
// committed together, so the message is processed: the attempt record is cleared as Commit
// would have, and the transaction ends as committed. Otherwise it ends as failed.
func (t *claimTx) committedByHandler(ctx context.Context) bool {
	if t.h.ended.Load() || t.conn.Conn().IsClosed() || t.conn.Conn().PgConn().TxStatus() != 'I' {
		return false
	}
	committed := false
	_ = t.end(ctx, func(ctx context.Context) error {
		q := t.s.q.storedHash
		a := keyArgs(t.key, t.period)
		err := t.conn.QueryRow(ctx, q.sql, q.args(a)...).Scan(new(any), new(any))
		committed = err == nil
		if committed && t.dirty {
			_, _ = t.conn.Exec(ctx, t.s.q.clearProcessed.sql, t.s.q.clearProcessed.args(a)...)
		}
		if !committed {
			t.commitFailed = true
		}
		return nil
	})
	return committed
}

// commitAlone sends COMMIT alone, in the simple protocol's one message (as pgx's own Tx
// sends it), and classifies its outcome as commitWith does.
func commitAlone(ctx context.Context, conn *pgxpool.Conn) error {
	results, err := conn.Conn().PgConn().Exec(ctx, "commit").ReadAll()
	switch {
	case err == nil && len(results) > 0 && results[0].CommandTag.String() == "COMMIT":
		return nil
	case err == nil && len(results) > 0:
		err = pgx.ErrTxCommitRollback
	}
	return rolledBack(err)
}

// rolledBack wraps a commit error with contract.ErrCommitRolledBack when the rollback is
// certain: the server answered ROLLBACK, or raised an error. Any other error (the connection
// broke) leaves the outcome unknown and is returned as it is.
func rolledBack(err error) error {
	var pgErr *pgconn.PgError
	if errors.Is(err, pgx.ErrTxCommitRollback) || errors.As(err, &pgErr) {
		return fmt.Errorf("%w: %w", contract.ErrCommitRolledBack, err)
	}
	return err
}

// clearKey names a key whose attempt record the commit clears.
type clearKey struct {
	key    inbox.Key
	period time.Time
}

// commitWith sends COMMIT on conn with the clean-up of clear's attempt records (see
// claimTx.Commit), and classifies its outcome.
func (s *Store) commitWith(ctx context.Context, conn *pgxpool.Conn, iso pgx.TxIsoLevel, clear []clearKey, rel release) error {
	q := s.q.clearProcessed
	inside := iso == pgx.ReadCommitted && conn.Conn().PgConn().TxStatus() == 'T'
	if len(clear) == 0 && rel.none() {
		return commitAlone(ctx, conn)
	}
	b := &pgx.Batch{}
	if inside {
		for _, c := range clear {
			b.Queue(q.sql, q.args(keyArgs(c.key, c.period))...)
		}
	}
	var tag pgconn.CommandTag
	b.Queue("commit").Exec(func(ct pgconn.CommandTag) error { tag = ct; return nil })
	if !inside {
		for _, c := range clear {
			b.Queue(s.q.clearProcessedAsync.sql, s.q.clearProcessedAsync.args(keyArgs(c.key, c.period))...)
		}
	}
	unlocked := false
	if !rel.none() {
		s.queueRelease(b, rel).Exec(func(pgconn.CommandTag) error { unlocked = true; return nil })
	}
	err := conn.Conn().SendBatch(ctx, b).Close()
	switch {
	case tag.String() == "COMMIT" && !rel.none() && !unlocked:
		// Committed, but the key's session lock may still be held: do not reuse the
		// connection.
		_ = conn.Conn().Close(ctx)
		return nil
	case tag.String() == "COMMIT":
		return nil // committed; a failed clean-up after COMMIT only leaves a stale record
	case tag.String() != "":
		err = pgx.ErrTxCommitRollback
	}
	err = rolledBack(err)
	if errors.Is(err, contract.ErrCommitRolledBack) && tag.String() == "" && !conn.Conn().IsClosed() && conn.Conn().PgConn().TxStatus() != 'I' {
		// The clean-up failed before COMMIT ran: the transaction is aborted; end it.
		_, _ = conn.Conn().PgConn().Exec(ctx, "rollback").ReadAll()
	}
	return err
}

// Fail ends the transaction without processing the message and records f: a failure that
// Counts uses up one attempt (this delivery's count, if it counted first, is that attempt) and
// keeps f.Error as the last error; one that does not takes this delivery's count back. With
// attempt counting the claim holds the key's lock for its session (claim.sql with .Session, or
// count_first.sql), which outlives the rollback: Fail rolls back, then writes the record on
// the same connection and releases the lock, so a copy waiting for the key reads the record.
// After a failed Commit (the lock released with it) the record is written on the store's count
// connection (count.go).
func (t *claimTx) Fail(ctx context.Context, f contract.Failure) (int, error) {
	if t.ended && !t.commitFailed {
		return t.attempts, nil // committed, or failed already
	}
	t.commitFailed = false
	delta := b2i(f.Counts) - b2i(t.counted)
	if !t.counting || (delta == 0 && !f.Counts) {
		return t.attempts, t.end(ctx, t.rollback)
	}
	t.counted = false
	errText := ""
	if f.Counts {
		errText = f.Error
	}
	if t.session && !t.ended {
		// Counted first: the key's session lock outlives the rollback, so the record is
		// written after it, on this connection (the claim's transaction held the record's row,
		// cleared inside it).
		var n int
		var aerr error
		rerr := t.end(ctx, func(ctx context.Context) error {
			err := t.rollback(ctx)
			var q querier = t.conn
			if t.conn.Conn().IsClosed() {
				// The connection is gone, and the key's lock and the transaction with it:
				// record on another.
				q, err = t.s.pool, nil
			}
			if err == nil {
				n, aerr = t.s.record(ctx, q, t.key, t.period, delta, errText)
			}
			return err
		})
		if aerr != nil || rerr != nil {
			return max(t.attempts+delta, 0), fmt.Errorf("pgstore: record the failure: %w", errors.Join(aerr, rerr))
		}
		t.attempts = n
		return n, nil
	}
	n, aerr := t.s.counter.record(t.key, t.period, delta, errText, t.finish)
	var rerr error
	if errors.Is(aerr, errCountConnect) {
		// Nothing was sent: record on the transaction's own connection after its rollback
		// (the key is released first, so a copy racing this may read the count one short).
		rerr = t.end(ctx, func(ctx context.Context) error {
			err := t.rollback(ctx)
			n, aerr = t.s.record(ctx, t.conn, t.key, t.period, delta, errText)
			return err
		})
	} else {
		rerr = t.end(ctx, t.rollback)
	}
	if aerr != nil {
		return max(t.attempts+delta, 0), fmt.Errorf("pgstore: record the failure: %w", errors.Join(aerr, rerr))
	}
	t.attempts = n
	return n, rerr
}

// querier is what record runs on: the pool, or a connection acquired from it.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// record applies delta to k's attempt record with errText as its last error, on q
// (recordStatement), and returns the count afterwards (0 when nothing was recorded).
func (s *Store) record(ctx context.Context, q querier, k inbox.Key, period time.Time, delta int, errText string) (int, error) {
	stmt, a := s.recordStatement(k, period, delta, errText)
	var n int32
	err := q.QueryRow(ctx, stmt.sql, stmt.args(a)...).Scan(&n)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	return int(n), nil
}

// recordStatement is the statement that applies delta to k's attempt record with errText as
// its last error: a positive delta (a failure not counted before) by
// queries/count_failure.sql, unless the key is processed or dead-lettered; zero or -1 by
// queries/settle_count.sql. Both return the count afterwards.
func (s *Store) recordStatement(k inbox.Key, period time.Time, delta int, errText string) (query, *queryArgs) {
	a := keyArgs(k, period)
	a.delta = int32(delta)
	a.lastError = nullIfEmpty(truncateUTF8(errText, maxErrorBytes))
	if delta > 0 {
		return s.q.countFailure, a
	}
	return s.q.settleCount, a
}

// registerConsumer makes sure name has a row in the consumers table (compact layout), once
// per store and name (queries/register_consumer.sql).
func (s *Store) registerConsumer(ctx context.Context, name string) error {
	if s.cfg.Layout != LayoutCompact {
		return nil
	}
	if _, ok := s.registered.Load(name); ok {
		return nil
	}
	// Through acquire, so that a pool with every connection in use gives the claim's error
	// (ErrWaitingForConnection) here too.
	conn, err := s.acquire(ctx)
	if err != nil {
		return err
	}
	_, err = conn.Exec(ctx, s.q.registerConsumer.sql, s.q.registerConsumer.args(&queryArgs{consumerName: name})...)
	conn.Release()
	if err != nil {
		return fmt.Errorf("pgstore: register consumer name: %w", err)
	}
	s.registered.Store(name, true)
	return nil
}

// release says which session-level advisory locks a COMMIT's round trip releases: one key's
// (queries/unlock.sql), or, for a batch, every one the connection holds
// (pg_advisory_unlock_all).
type release struct {
	key string
	all bool
}

func (r release) none() bool { return r.key == "" && !r.all }

// queueRelease queues the statement that releases r on b.
func (s *Store) queueRelease(b *pgx.Batch, r release) *pgx.QueuedQuery {
	if r.all {
		return b.Queue("SELECT pg_advisory_unlock_all()")
	}
	return b.Queue(s.q.unlock.sql, s.q.unlock.args(&queryArgs{lockKey: r.key})...)
}
