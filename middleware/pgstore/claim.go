package pgstore

import (
	"context"
	"errors"
	"fmt"
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
// The attempt record is read only with attempt counting (a dead-letter topic). A duplicate
// costs one more round trip (queries/stored_hash.sql, ROLLBACK, and with counting
// queries/clear_processed.sql). A delivery that counts first (d.CountFirst) is counted after
// its claim, by queries/count.sql, shared with the other deliveries asking at the same moment
// (count.go). A key whose lock a delivery in flight holds is waited for in process, without a
// connection, until ctx ends (ErrClaimInFlight). On error nothing is left open and nothing
// counted.
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
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{IsoLevel: lvl})
	s.queueTimeouts(b)
	claimed := false
	b.Queue(s.q.claim.sql, s.q.claim.args(s.claimArgs(d, period))...).Exec(func(ct pgconn.CommandTag) error {
		claimed = ct.RowsAffected() == 1
		return nil
	})
	var rec contract.Record
	if t.counting {
		b.Queue(s.q.record.sql, s.q.record.args(keyArgs(d.Key, period))...).QueryRow(func(row pgx.Row) error {
			return scanRecord(row, &rec)
		})
	}
	if err := s.sendClaim(ctx, conn, b, t); err != nil {
		_ = t.end(ctx, func(ctx context.Context) error {
			_, _ = t.conn.Exec(ctx, "rollback")
			return nil
		})
		return nil, contract.Claim{}, fmt.Errorf("pgstore: claim: %w", s.wrapNoPartition(err, period))
	}
	if !claimed {
		stored, err := t.endDuplicate(ctx)
		if err != nil {
			return nil, contract.Claim{}, err
		}
		return nil, contract.Decide(d, false, stored, contract.Record{}), nil
	}
	c := contract.Decide(d, true, nil, rec)
	if c.Decision == contract.Run && t.counting && d.CountFirst {
		c, err = t.countFirst(ctx, d, c)
		if err != nil {
			return nil, contract.Claim{}, err
		}
	}
	if c.Decision != contract.Run {
		// Not run after all (dead-lettered, exhausted, to run alone): nothing of this try is
		// kept, and nothing was counted.
		if err := t.end(ctx, t.rollback); err != nil {
			return nil, contract.Claim{}, fmt.Errorf("pgstore: claim: roll back: %w", err)
		}
		return nil, c, nil
	}
	t.attempts = c.Attempts + b2i(t.counted)
	// Commit clears the key's attempt record when it may have one: one was read, this
	// delivery counted, or the snapshot could have missed one.
	t.dirty = t.counting && (t.counted || rec.Attempts > 0 || rec.LastError != "" || lvl != pgx.ReadCommitted)
	t.h = &handlerTx{Tx: t.tx}
	return t, c, nil
}

// countFirst counts the claimed delivery's attempt before its handler runs (count.go), while
// its claim holds the key's lock, so no copy of the message counts meanwhile.
func (t *claimTx) countFirst(ctx context.Context, d contract.Delivery, c contract.Claim) (contract.Claim, error) {
	n, err := t.s.counter.count(ctx, []inbox.Key{d.Key}, t.finish)
	if err != nil {
		_ = t.end(ctx, t.rollback)
		return c, fmt.Errorf("pgstore: count the attempt: %w", err)
	}
	if n[0] < 0 {
		// Dead-lettered since the record was read (not counted).
		c.Decision = contract.DeadLettered
		return c, nil
	}
	t.counted = true
	return c, nil
}

// endDuplicate ends the transaction of a claim that inserted nothing, in one round trip: it
// reads the stored payload hash, rolls back and, with counting, deletes the key's stale
// attempt record (the key is processed). No stored row means the key's lock was held by a
// delivery in flight: errKeyHeld, and the record is left alone (the delete checks the row).
func (t *claimTx) endDuplicate(ctx context.Context) ([]byte, error) {
	s := t.s
	var stored []byte
	held := false
	err := t.end(ctx, func(ctx context.Context) error {
		b := &pgx.Batch{}
		b.Queue(s.q.storedHash.sql, s.q.storedHash.args(keyArgs(t.key, t.period))...).QueryRow(func(row pgx.Row) error {
			err := s.scanHash(row, &stored)
			if errors.Is(err, pgx.ErrNoRows) {
				held = true
				return nil
			}
			return err
		})
		b.Queue("rollback")
		if t.counting {
			b.Queue(s.q.clearProcessed.sql, s.q.clearProcessed.args(keyArgs(t.key, t.period))...)
		}
		if err := t.conn.Conn().SendBatch(ctx, b).Close(); err != nil {
			_, _ = t.conn.Exec(ctx, "rollback")
			return fmt.Errorf("pgstore: claim: read stored payload hash: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if held {
		return nil, errKeyHeld
	}
	return stored, nil
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

// handlerTx is the transaction a handler gets: the inbox's pgx.Tx, whose Commit and Rollback
// it refuses and remembers.
type handlerTx struct {
	pgx.Tx
	ended atomic.Bool
}

func (h *handlerTx) Commit(context.Context) error   { h.ended.Store(true); return ErrTxOwnedByInbox }
func (h *handlerTx) Rollback(context.Context) error { h.ended.Store(true); return ErrTxOwnedByInbox }

// endedOn returns nil while the inbox transaction on conn is open and the handler has not tried
// to end it, else an error wrapping contract.ErrTxEnded. A transaction in the failed state
// (a swallowed failed statement) is open: COMMIT answers ROLLBACK for it. Nothing is sent.
func (h *handlerTx) endedOn(conn *pgxpool.Conn) error {
	switch {
	case h.ended.Load():
		return fmt.Errorf("%w: it called Commit or Rollback (%w)", contract.ErrTxEnded, contract.ErrCommitRolledBack)
	case conn.Conn().IsClosed():
		return fmt.Errorf("%w: its connection is closed (%w)", contract.ErrTxEnded, contract.ErrCommitRolledBack)
	case conn.Conn().PgConn().TxStatus() == 'I':
		return fmt.Errorf("%w: a COMMIT or ROLLBACK statement ran (%w)", contract.ErrTxEnded, contract.ErrCommitRolledBack)
	}
	return nil
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
	counted  bool // this delivery was counted before its handler
	attempts int  // the key's count with this delivery's own, as the claim found it
	dirty    bool // the key may have an attempt record for Commit to clear
	poisoned bool // a cancel request was sent on conn: close it rather than reuse it
	ended    bool
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
// with the tag COMMIT and a warning, which would ack a message whose claim is gone). COMMIT
// and, when the key may have an attempt record, queries/clear_processed.sql travel in one
// round trip; a crash between the two leaves a stale record of a processed key, which the
// key's next duplicate removes.
//
// An error wraps inbox.ErrCommitRolledBack when the rollback is certain: the handler ended
// the transaction (ErrTxEnded), the server answered ROLLBACK (a statement had failed), or
// COMMIT raised an error (a *pgconn.PgError, such as a deferred constraint's SQLSTATE 23505,
// or 40001 under SERIALIZABLE). Any other error leaves the outcome unknown.
func (t *claimTx) Commit(ctx context.Context) error {
	if t.ended {
		return nil
	}
	if err := t.h.endedOn(t.conn); err != nil {
		t.commitFailed = true
		_ = t.end(ctx, t.rollback)
		return err
	}
	return t.end(ctx, func(ctx context.Context) error {
		b := &pgconn.Batch{}
		b.ExecParams("commit", nil, nil, nil, nil)
		if t.dirty {
			q := t.s.q.clearProcessed
			b.ExecParams(q.sql, textArgs(q.args(keyArgs(t.key, t.period))), nil, nil, nil)
		}
		results, err := t.conn.Conn().PgConn().ExecBatch(ctx, b).ReadAll()
		switch {
		case len(results) > 0 && results[0].Err != nil:
			err = results[0].Err
		case len(results) > 0 && results[0].CommandTag.String() != "COMMIT":
			err = pgx.ErrTxCommitRollback
		case len(results) > 0:
			return nil // committed; a failed clean-up after COMMIT only leaves a stale record
		}
		t.commitFailed = true
		var pgErr *pgconn.PgError
		if errors.Is(err, pgx.ErrTxCommitRollback) || errors.As(err, &pgErr) {
			return fmt.Errorf("%w: %w", contract.ErrCommitRolledBack, err)
		}
		return err
	})
}

// textArgs renders the parameters of a key statement for pgconn's ExecParams (text format).
func textArgs(args []any) [][]byte {
	out := make([][]byte, len(args))
	for k, a := range args {
		switch v := a.(type) {
		case string:
			out[k] = []byte(v)
		case time.Time:
			out[k] = []byte(v.Format(time.RFC3339Nano))
		default:
			panic(fmt.Sprintf("pgstore: textArgs: %T", a))
		}
	}
	return out
}

// failAcquireTimeout bounds Fail's wait for a second pool connection; past it Fail records
// after the rollback instead.
const failAcquireTimeout = 500 * time.Millisecond

// Fail ends the transaction without processing the message and records f: a failure that
// Counts uses up one attempt (this delivery's count, if it counted first, is that attempt) and
// keeps f.Error as the last error; one that does not takes this delivery's count back. The
// record is written on a second pool connection, committed while this transaction still holds
// the claim and the key's lock, and only then is this transaction rolled back, so a copy
// waiting for the key reads it. When no second connection is free within failAcquireTimeout
// (a pool exhausted by deliveries that all fail at once), it rolls back first and records
// afterwards. After a failed Commit it records on the pool.
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
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.finish)
	defer cancel()
	estimate := max(t.attempts+delta, 0)
	var rerr error
	if !t.ended {
		actx, acancel := context.WithTimeout(dctx, min(t.finish, failAcquireTimeout))
		conn, err := t.s.pool.Acquire(actx)
		acancel()
		if err == nil {
			n, aerr := t.s.record(dctx, conn, t.key, t.period, delta, errText)
			conn.Release()
			rerr = t.end(ctx, t.rollback)
			var pgErr *pgconn.PgError
			if aerr == nil || !errors.As(aerr, &pgErr) {
				t.attempts = n
				if aerr != nil {
					return estimate, fmt.Errorf("pgstore: record the failure: %w", errors.Join(aerr, rerr))
				}
				return n, rerr
			}
			// The server refused it, so nothing was applied: once more, after the rollback.
		} else {
			rerr = t.end(ctx, t.rollback)
		}
	}
	n, aerr := t.s.record(dctx, t.s.pool, t.key, t.period, delta, errText)
	if aerr != nil {
		return estimate, fmt.Errorf("pgstore: record the failure: %w", errors.Join(aerr, rerr))
	}
	t.attempts = n
	return n, rerr
}

// querier is what record runs on: the pool, or a connection acquired from it.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// record applies delta to k's attempt record with errText as its last error: a positive delta
// (a failure not counted before) by queries/count_failure.sql, unless the key is processed or
// dead-lettered; zero or -1 by queries/settle_count.sql. It returns the count afterwards (0
// when nothing was recorded).
func (s *Store) record(ctx context.Context, q querier, k inbox.Key, period time.Time, delta int, errText string) (int, error) {
	a := keyArgs(k, period)
	a.delta = int32(delta)
	a.lastError = nullIfEmpty(truncateUTF8(errText, maxErrorBytes))
	stmt := s.q.settleCount
	if delta > 0 {
		stmt = s.q.countFailure
	}
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
