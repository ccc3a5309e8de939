package sqlstore

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/sqltx"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

type keyT = contract.Key

// TxFromContext returns the inbox transaction of the delivery whose context is ctx (the
// handler's msg.Context()), and false outside an inbox-wrapped handler. Run the handler's
// business writes on it so they commit or roll back with the claim. Do not end it: the
// inbox commits after the handler returns. A *sql.Tx cannot refuse Commit or Rollback, so
// the store detects them instead: a Commit or Rollback call, or a COMMIT or ROLLBACK
// statement (PostgreSQL: the connection's transaction status; MariaDB: @@in_transaction),
// makes the delivery fail with contract.ErrTxEnded (nacked, counted as the message's
// failure). A handler that committed this way committed its claim with its writes, so the
// redelivery is a duplicate; one that rolled back lost them both.
func TxFromContext(ctx context.Context) (*sql.Tx, bool) {
	tx, _, ok := sqltx.From(ctx)
	return tx, ok
}

// DialectFromContext returns the dialect of the inbox transaction ctx carries
// (TxFromContext), and false outside one: for handler code that writes dialect-specific SQL.
func DialectFromContext(ctx context.Context) (Dialect, bool) {
	_, postgres, ok := sqltx.From(ctx)
	if postgres {
		return PostgreSQL, ok
	}
	return MySQL, ok
}

// isoLevel maps the delivery's level: sql.LevelDefault is READ COMMITTED on both databases
// (the contract's default; MySQL's own default is REPEATABLE READ).
func isoLevel(l sql.IsolationLevel) (sql.IsolationLevel, error) {
	switch l {
	case sql.LevelDefault, sql.LevelReadCommitted:
		return sql.LevelReadCommitted, nil
	case sql.LevelRepeatableRead, sql.LevelSerializable:
		return l, nil
	}
	return 0, fmt.Errorf("%w: sqlstore: isolation level %s is not supported", inbox.ErrInvalidConfig, l)
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

// session is one connection held for a claim or a batch, with the key locks it holds
// (MySQL's GET_LOCK names).
type session struct {
	s      *Store
	conn   *sql.Conn
	finish time.Duration
	locks  []string
	bad    bool // close the connection rather than return it to the pool
	closed bool
}

func (s *Store) openSession(ctx context.Context, finish time.Duration) (*session, error) {
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return nil, fmt.Errorf("sqlstore: take a connection: %w", err)
	}
	return &session{s: s, conn: conn, finish: finish}, nil
}

// tryLock tries the lock name (MySQL: GET_LOCK(name, 0)) and reports whether it took it.
func (se *session) tryLock(ctx context.Context, name string) (bool, error) {
	var got sql.NullInt64
	if err := se.s.q.getLock.row(ctx, se.conn, &queryArgs{lockName: name}).Scan(&got); err != nil {
		se.bad = true
		return false, fmt.Errorf("sqlstore: claim: lock the key: %w", err)
	}
	if !got.Valid {
		return false, errors.New("sqlstore: claim: lock the key: GET_LOCK returned NULL")
	}
	if got.Int64 == 1 {
		se.locks = append(se.locks, name)
	}
	return got.Int64 == 1, nil
}

// close releases the session's locks, detached from ctx's cancellation, and returns the
// connection to the pool; a connection whose locks could not be released is closed (which
// releases them on the server).
func (se *session) close(ctx context.Context) {
	if se.closed {
		return
	}
	se.closed = true
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), se.finish)
	defer cancel()
	for _, name := range se.locks {
		var x sql.NullInt64
		if err := se.s.q.releaseLock.row(dctx, se.conn, &queryArgs{lockName: name}).Scan(&x); err != nil {
			se.bad = true
			break
		}
	}
	se.locks = nil
	if se.bad {
		_ = se.conn.Raw(func(any) error { return driver.ErrBadConn })
	}
	_ = se.conn.Close()
}

// txEnded returns nil while tx is the open inbox transaction, else an error wrapping
// contract.ErrTxEnded and contract.ErrCommitRolledBack: PostgreSQL, from the connection's
// transaction status (no round trip); MySQL, from @@in_transaction (one round trip; MySQL
// servers lack the variable, error 1193, and then the check is skipped).
func (se *session) txEnded(ctx context.Context, tx *sql.Tx) error {
	ended := false
	if se.s.d.sessionLock {
		var in sql.NullInt64
		err := se.s.q.inTransaction.row(ctx, tx, &queryArgs{}).Scan(&in)
		switch {
		case errors.Is(err, sql.ErrTxDone):
			return fmt.Errorf("%w: it called Commit or Rollback (%w)", contract.ErrTxEnded, contract.ErrCommitRolledBack)
		case err == nil && in.Valid && in.Int64 == 0:
			ended = true
		}
	} else {
		var status byte
		closed := false
		_ = se.conn.Raw(func(dc any) error {
			if c, ok := dc.(*stdlib.Conn); ok {
				status, closed = c.Conn().PgConn().TxStatus(), c.Conn().IsClosed()
			}
			return nil
		})
		if closed {
			return fmt.Errorf("%w: its connection is closed (%w)", contract.ErrTxEnded, contract.ErrCommitRolledBack)
		}
		ended = status == 'I'
	}
	if ended {
		return fmt.Errorf("%w: a COMMIT or ROLLBACK statement ran (%w)", contract.ErrTxEnded, contract.ErrCommitRolledBack)
	}
	return nil
}

// commitErr interprets tx.Commit's error: certain rollbacks wrap contract.ErrCommitRolledBack
// (sql.ErrTxDone: the handler ended the transaction, contract.ErrTxEnded too).
func commitErr(err error) error {
	switch {
	case errors.Is(err, sql.ErrTxDone):
		return fmt.Errorf("%w: it called Commit or Rollback (%w)", contract.ErrTxEnded, contract.ErrCommitRolledBack)
	case serverError(err):
		return fmt.Errorf("%w: %w", contract.ErrCommitRolledBack, err)
	}
	return err
}

// Claim claims d.Key and decides (contract.Decide). On PostgreSQL:
//
//	BEGIN; queries/postgres/claim.sql (tries the key's advisory lock); [record.sql]
//
// on MySQL the key's lock is tried first, on the session, and released after the
// transaction ends:
//
//	GET_LOCK(name, 0); BEGIN; queries/mysql/claim.sql; [record.sql] ... COMMIT; RELEASE_LOCK
//
// The attempt record is read only with counting (MaxAttempts > 0), after the claim. A key
// held by a delivery in flight is waited for in process, without a connection, until ctx
// ends (ErrClaimInFlight). A delivery that counts first is counted after its claim by the
// claim's holder, grouped with the others (count.go). On error nothing is left open and
// nothing counted.
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

// claimTx is an open claim transaction on its session.
type claimTx struct {
	se       *session
	tx       *sql.Tx
	key      keyT
	counting bool
	counted  bool // counted before its handler
	attempts int  // the key's count with this delivery's own, as the claim found it
	dirty    bool // the key may have an attempt record for Commit to clear
	ended    bool
	// commitFailed: Commit ended the transaction without committing (or with an unknown
	// outcome); Fail then records outside it.
	commitFailed bool
}

// claimOnce is one try of Claim; errKeyHeld means the key's lock was held.
func (s *Store) claimOnce(ctx context.Context, d contract.Delivery) (*claimTx, contract.Claim, error) {
	lvl, err := isoLevel(d.Isolation)
	if err != nil {
		return nil, contract.Claim{}, err
	}
	if err := s.Check(d); err != nil {
		return nil, contract.Claim{}, err
	}
	se, err := s.openSession(ctx, finishTimeout(d.FinishTimeout))
	if err != nil {
		return nil, contract.Claim{}, err
	}
	t := &claimTx{se: se, key: d.Key, counting: d.MaxAttempts > 0}
	if s.d.sessionLock {
		got, err := se.tryLock(ctx, s.lockName(d.Key))
		if err != nil || !got {
			se.close(ctx)
			if err == nil {
				err = errKeyHeld
			}
			return nil, contract.Claim{}, err
		}
	}
	claimed, rec, err := t.begin(ctx, d, lvl)
	if err != nil {
		t.end(ctx, false)
		return nil, contract.Claim{}, fmt.Errorf("sqlstore: claim: %w", err)
	}
	if !claimed {
		stored, at, err := t.endDuplicate(ctx)
		if err != nil {
			return nil, contract.Claim{}, err
		}
		c := contract.Decide(d, false, stored, contract.Record{})
		c.StoredAt = at
		return nil, c, nil
	}
	c := contract.Decide(d, true, nil, rec)
	if c.Decision == contract.Run && t.counting && d.CountFirst {
		n, err := s.counter.count(ctx, []keyT{d.Key}, se.finish)
		if err != nil {
			t.end(ctx, false)
			return nil, contract.Claim{}, fmt.Errorf("sqlstore: count the attempt: %w", err)
		}
		if n[0] < 0 {
			c.Decision = contract.DeadLettered // dead-lettered since the record was read
		} else {
			t.counted = true
		}
	}
	if c.Decision != contract.Run {
		t.end(ctx, false) // nothing of this try is kept, and nothing was counted
		return nil, c, nil
	}
	t.attempts = c.Attempts + b2i(t.counted)
	t.dirty = t.counting && (t.counted || rec.Attempts > 0 || rec.LastError != "" || lvl != sql.LevelReadCommitted)
	return t, c, nil
}

// begin opens the transaction (on a context ctx's end does not break: the inbox ends it),
// runs the claim and, with counting, reads the record.
func (t *claimTx) begin(ctx context.Context, d contract.Delivery, lvl sql.IsolationLevel) (bool, contract.Record, error) {
	s := t.se.s
	var rec contract.Record
	tx, err := t.se.conn.BeginTx(context.WithoutCancel(ctx), &sql.TxOptions{Isolation: lvl})
	if err != nil {
		t.se.bad = true
		return false, rec, err
	}
	t.tx = tx
	res, err := s.q.claim.exec(ctx, tx, s.claimArgs(d))
	if err != nil {
		return false, rec, err
	}
	n, err := res.RowsAffected()
	if err != nil || n != 1 {
		return false, rec, err
	}
	if t.counting {
		if err := s.readRecord(ctx, tx, d.Key, &rec); err != nil {
			return false, rec, err
		}
	}
	return true, rec, nil
}

// readRecord reads k's attempt record (queries/<dialect>/record.sql); none leaves rec zero.
func (s *Store) readRecord(ctx context.Context, e execer, k keyT, rec *contract.Record) error {
	err := s.q.record.row(ctx, e, keyArgs(k)).Scan(&rec.Attempts, &rec.LastError, &rec.DeadLettered)
	if errors.Is(err, sql.ErrNoRows) {
		return nil
	}
	return err
}

// claimArgs are the claim statement's parameters for d.
func (s *Store) claimArgs(d contract.Delivery) *queryArgs {
	a := keyArgs(d.Key)
	a.messageType = nullIfEmpty(truncateUTF8(d.MessageType, 512))
	a.correlationID = nullIfEmpty(truncateUTF8(d.CorrelationID, 512))
	a.payloadHash = d.PayloadHash
	a.lockName = s.lockName(d.Key)
	return a
}

// end rolls back (unless committed), detached from ctx's cancellation, and closes the
// session.
func (t *claimTx) end(ctx context.Context, committed bool) {
	if t.ended {
		return
	}
	t.ended = true
	if t.tx != nil && !committed {
		_ = t.tx.Rollback() // ErrTxDone when the handler or the server ended it
	}
	t.se.close(ctx)
}

// endDuplicate ends the transaction of a claim that inserted nothing: it reads the stored
// payload hash, rolls back and, with counting, deletes the processed key's stale attempt
// record. No stored row (PostgreSQL) means the key's lock was held: errKeyHeld.
func (t *claimTx) endDuplicate(ctx context.Context) ([]byte, time.Time, error) {
	s := t.se.s
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.se.finish)
	defer cancel()
	stored, at, err := s.storedHash(dctx, t.tx, t.key)
	held := errors.Is(err, sql.ErrNoRows)
	t.end(ctx, false)
	switch {
	case held:
		return nil, at, errKeyHeld
	case err != nil:
		return nil, at, fmt.Errorf("sqlstore: claim: read stored payload hash: %w", err)
	}
	if t.counting {
		_, _ = s.q.clearProcessed.exec(dctx, s.db, keyArgs(t.key)) // best effort: only a stale record
	}
	return stored, at, nil
}

// storedHash reads an existing claim's payload hash (empty, not nil, when none was kept) and
// when it was stored (queries/<dialect>/stored_hash.sql); sql.ErrNoRows when there is none.
func (s *Store) storedHash(ctx context.Context, e execer, k keyT) ([]byte, time.Time, error) {
	var stored []byte
	var epoch sql.NullFloat64
	if err := s.q.storedHash.row(ctx, e, keyArgs(k)).Scan(&stored, &epoch); err != nil {
		return nil, time.Time{}, err
	}
	if stored == nil {
		stored = []byte{}
	}
	var at time.Time
	if epoch.Valid {
		at = time.UnixMicro(int64(epoch.Float64 * 1e6))
	}
	return stored, at, nil
}

// Context returns ctx carrying the inbox's *sql.Tx (TxFromContext).
func (t *claimTx) Context(ctx context.Context) context.Context {
	return sqltx.With(ctx, t.tx, t.se.s.cfg.Dialect == PostgreSQL)
}

// Commit commits, after checking that the handler did not end the transaction (ErrTxEnded),
// then releases the key's lock (MySQL) and, when the key may have an attempt record, deletes
// it (queries/<dialect>/clear_processed.sql; a failure there only leaves a stale record of a
// processed key, which its next duplicate removes). An error wrapping
// contract.ErrCommitRolledBack: certainly not committed (the handler ended the transaction,
// or the server answered COMMIT with an error or with ROLLBACK); any other: unknown.
func (t *claimTx) Commit(ctx context.Context) error {
	if t.ended {
		return nil
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.se.finish)
	defer cancel()
	if err := t.se.txEnded(dctx, t.tx); err != nil {
		t.commitFailed = true
		t.end(ctx, false)
		return err
	}
	if err := t.tx.Commit(); err != nil {
		t.commitFailed = true
		if !serverError(err) && !errors.Is(err, sql.ErrTxDone) {
			t.se.bad = true // unknown outcome: never reuse the session
		}
		t.end(ctx, true)
		return commitErr(err)
	}
	t.end(ctx, true)
	if t.dirty {
		_, _ = t.se.s.q.clearProcessed.exec(dctx, t.se.s.db, keyArgs(t.key))
	}
	return nil
}

// failAcquireTimeout bounds Fail's wait for a second connection; past it Fail records after
// the rollback instead.
const failAcquireTimeout = 500 * time.Millisecond

// Fail ends the transaction without processing the message and records f: a failure that
// Counts uses up one attempt (this delivery's count, if it counted first, is that attempt)
// and keeps f.Error as the last error; one that does not takes this delivery's count back.
// As in pgstore, the record is written on a second connection and committed while this
// transaction still holds the claim and the key's lock; only then is this transaction
// rolled back (and, on MySQL, the key's lock released), so a copy waiting for the key reads
// it. When no second connection is free within failAcquireTimeout, it rolls back first and
// records afterwards.
func (t *claimTx) Fail(ctx context.Context, f contract.Failure) (int, error) {
	if t.ended && !t.commitFailed {
		return t.attempts, nil
	}
	t.commitFailed = false
	delta := b2i(f.Counts) - b2i(t.counted)
	if !t.counting || (delta == 0 && !f.Counts) {
		t.end(ctx, false)
		return t.attempts, nil
	}
	t.counted = false
	errText := ""
	if f.Counts {
		errText = f.Error
	}
	s := t.se.s
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.se.finish)
	defer cancel()
	estimate := max(t.attempts+delta, 0)
	if !t.ended {
		actx, acancel := context.WithTimeout(dctx, min(t.se.finish, failAcquireTimeout))
		conn, err := s.db.Conn(actx)
		acancel()
		if err == nil {
			n, rerr := s.record(dctx, conn, t.key, delta, errText)
			_ = conn.Close()
			if rerr == nil || !serverError(rerr) {
				t.end(ctx, false)
				t.attempts = n
				if rerr != nil {
					return estimate, fmt.Errorf("sqlstore: record the failure: %w", rerr)
				}
				return n, nil
			}
			// The server refused it, so nothing was applied: once more, after the rollback.
		}
		t.end(ctx, false)
	}
	n, err := s.record(dctx, s.db, t.key, delta, errText)
	if err != nil {
		return estimate, fmt.Errorf("sqlstore: record the failure: %w", err)
	}
	t.attempts = n
	return n, nil
}

// beginner is a *sql.DB or a *sql.Conn.
type beginner interface {
	BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error)
}

// record applies delta to k's attempt record with errText as its last error, in a READ
// COMMITTED transaction of its own, retried on a transient conflict: a positive delta (a
// failure not counted before) by count_failure.sql, unless the key is processed or
// dead-lettered; zero or -1 by record_for_update.sql then settle_update.sql or
// settle_delete.sql (a record left with no attempt and no error is deleted). It returns the
// count afterwards (0 when nothing was recorded).
func (s *Store) record(ctx context.Context, b beginner, k keyT, delta int, errText string) (int, error) {
	var n int
	err := s.inTx(ctx, b, func(tx *sql.Tx) (err error) {
		n, err = s.recordTx(ctx, tx, k, delta, errText)
		return err
	})
	return n, err
}

func (s *Store) recordTx(ctx context.Context, tx *sql.Tx, k keyT, delta int, errText string) (int, error) {
	a := keyArgs(k)
	a.lastError = nullIfEmpty(truncateUTF8(errText, maxErrorBytes))
	if delta > 0 {
		a.delta = delta
		res, err := s.q.countFailure.exec(ctx, tx, a)
		if err != nil {
			return 0, err
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			return 0, err
		}
		var rec contract.Record
		err = s.readRecord(ctx, tx, k, &rec)
		return rec.Attempts, err
	}
	var attempts int
	var last string
	err := s.q.recordForUpdate.row(ctx, tx, a).Scan(&attempts, &last)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	attempts = max(attempts+delta, 0)
	if errText != "" {
		last = errText
	}
	if attempts == 0 && last == "" {
		_, err = s.q.settleDelete.exec(ctx, tx, a)
		return 0, err
	}
	a.attempts, a.lastError = attempts, nullIfEmpty(truncateUTF8(last, maxErrorBytes))
	_, err = s.q.settleUpdate.exec(ctx, tx, a)
	return attempts, err
}

// txRetries is how many times inTx runs f after a transient conflict (Classify: Retryable).
const txRetries = 3

// inTx runs f in a READ COMMITTED transaction on b and commits, again (up to txRetries
// times) after a transient conflict: records and counts of distinct keys can deadlock on
// MySQL's gap locks.
func (s *Store) inTx(ctx context.Context, b beginner, f func(*sql.Tx) error) error {
	var err error
	for range txRetries {
		var tx *sql.Tx
		if tx, err = b.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted}); err != nil {
			return err
		}
		if err = f(tx); err == nil {
			if err = tx.Commit(); err == nil {
				return nil
			}
		} else {
			_ = tx.Rollback()
		}
		if s.Classify(err) != contract.Retryable {
			return err
		}
	}
	return err
}
