package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/sqltx"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// savepointName is the one savepoint name of a batch.
const savepointName = "inbox_member"

// errSwallowed is Healthy's error when a statement of a member's handler failed although the
// handler returned nil (PostgreSQL: the transaction is aborted).
var errSwallowed = errors.New("sqlstore: a statement of the handler failed but the handler returned nil; the transaction is aborted")

// ClaimBatch claims the keys of ds in one transaction (the inbox's batched mode), member by
// member with the single claim's statements, and decides for each. A member whose key a
// delivery in flight holds is decided RunAlone (the inbox claims it alone, where the claim
// waits). On MySQL the members' locks are tried first and released when the batch ends.
// Members not to run are taken out with drop_claim.sql; those that count first are counted
// together (count.go).
func (s *Store) ClaimBatch(ctx context.Context, ds []contract.Delivery) (contract.BatchTx, []contract.Claim, error) {
	if len(ds) == 0 {
		return nil, nil, fmt.Errorf("%w: sqlstore: empty batch", inbox.ErrInvalidConfig)
	}
	lvl, err := isoLevel(ds[0].Isolation)
	if err != nil {
		return nil, nil, err
	}
	seen := make(map[string]bool, len(ds))
	for _, d := range ds {
		if d.Key.ConsumerName != ds[0].Key.ConsumerName || seen[d.Key.MessageID] {
			return nil, nil, fmt.Errorf("%w: sqlstore: a batch holds distinct keys of one consumer", inbox.ErrInvalidConfig)
		}
		seen[d.Key.MessageID] = true
		if err := s.Check(d); err != nil {
			return nil, nil, err
		}
	}
	se, err := s.openSession(ctx, finishTimeout(ds[0].FinishTimeout))
	if err != nil {
		return nil, nil, err
	}
	t := &batchTx{claimTx: claimTx{se: se, counting: ds[0].MaxAttempts > 0}, iso: lvl, members: make([]member, len(ds))}
	claims, err := t.claim(ctx, ds)
	if err != nil {
		t.end(ctx, false)
		return nil, nil, fmt.Errorf("sqlstore: batch claim: %w", err)
	}
	if err := t.countFirst(ctx, ds, claims); err != nil {
		_ = t.Rollback(ctx)
		return nil, nil, fmt.Errorf("sqlstore: batch claim: count the attempts: %w", err)
	}
	return t, claims, nil
}

// member is one delivery of a batch, as the store keeps it.
type member struct {
	key      keyT
	in       bool // the transaction holds its claim
	counted  bool // counted before its handler, count not yet settled
	attempts int  // earlier attempts, as the claim found them
	dirty    bool // its attempt record may need clearing after COMMIT
}

// batchTx is the transaction of a batch, on one session.
type batchTx struct {
	claimTx
	iso     sql.IsolationLevel
	members []member
	pending []settle // records Drop could not write before the batch ended
	saved   bool     // a savepoint is open
}

// settle is a record to write for a member: delta and last error.
type settle struct {
	k     int
	delta int
	err   string
}

// claim sends the claims and decides for every member; members not to run are out of the
// transaction when it returns.
func (t *batchTx) claim(ctx context.Context, ds []contract.Delivery) ([]contract.Claim, error) {
	s := t.se.s
	claims := make([]contract.Claim, len(ds))
	held := make([]bool, len(ds))
	if s.d.sessionLock {
		for k, d := range ds {
			got, err := t.se.tryLock(ctx, s.lockName(d.Key))
			if err != nil {
				return nil, err
			}
			held[k] = !got
		}
	}
	tx, err := t.se.conn.BeginTx(context.WithoutCancel(ctx), &sql.TxOptions{Isolation: t.iso})
	if err != nil {
		t.se.bad = true
		return nil, err
	}
	t.tx = tx
	for k, d := range ds {
		m := &t.members[k]
		m.key = d.Key
		if held[k] {
			claims[k] = contract.Claim{Decision: contract.RunAlone}
			continue
		}
		res, err := s.q.claim.exec(ctx, tx, s.claimArgs(d))
		if err != nil {
			return nil, err
		}
		if n, err := res.RowsAffected(); err != nil {
			return nil, err
		} else if n != 1 {
			stored, at, err := s.storedHash(ctx, tx, d.Key)
			switch {
			case errors.Is(err, sql.ErrNoRows):
				claims[k] = contract.Claim{Decision: contract.RunAlone}
			case err != nil:
				return nil, err
			default:
				claims[k] = contract.Decide(d, false, stored, contract.Record{})
				claims[k].StoredAt = at
				m.dirty = t.counting // a processed key's record is stale: cleared after COMMIT
			}
			continue
		}
		var rec contract.Record
		if t.counting {
			if err := s.readRecord(ctx, tx, d.Key, &rec); err != nil {
				return nil, err
			}
		}
		claims[k] = contract.Decide(d, true, nil, rec)
		m.attempts = claims[k].Attempts
		if claims[k].Decision != contract.Run {
			if _, err := s.q.dropClaim.exec(ctx, tx, keyArgs(d.Key)); err != nil {
				return nil, err
			}
			continue
		}
		m.in = true
		m.dirty = t.counting && (rec.Attempts > 0 || rec.LastError != "" || t.iso != sql.LevelReadCommitted)
	}
	return claims, nil
}

// countFirst counts, in one request, the members to run that count first.
func (t *batchTx) countFirst(ctx context.Context, ds []contract.Delivery, claims []contract.Claim) error {
	var keys []keyT
	var idx []int
	for k, d := range ds {
		if t.counting && d.CountFirst && claims[k].Decision == contract.Run {
			keys, idx = append(keys, d.Key), append(idx, k)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	s := t.se.s
	counts, err := s.counter.count(ctx, keys, t.se.finish)
	if err != nil {
		return err
	}
	for j, k := range idx {
		m := &t.members[k]
		if counts[j] < 0 { // dead-lettered since the record was read
			claims[k].Decision = contract.DeadLettered
			m.in = false
			if _, err := s.q.dropClaim.exec(ctx, t.tx, keyArgs(m.key)); err != nil {
				return err
			}
			continue
		}
		m.counted, m.dirty = true, true
	}
	return nil
}

// Context returns ctx carrying the batch's *sql.Tx (TxFromContext).
func (t *batchTx) Context(ctx context.Context) context.Context {
	return sqltx.With(ctx, t.tx, t.se.s.cfg.Dialect == PostgreSQL)
}

// Savepoint marks the point Drop rolls back to: RELEASE SAVEPOINT of the open one, then
// SAVEPOINT.
func (t *batchTx) Savepoint(ctx context.Context) error {
	if t.ended {
		return errors.New("sqlstore: savepoint: the batch has ended")
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.se.finish)
	defer cancel()
	if t.saved {
		if _, err := t.tx.ExecContext(dctx, "RELEASE SAVEPOINT "+savepointName); err != nil {
			return fmt.Errorf("sqlstore: savepoint: %w", err)
		}
		t.saved = false
	}
	if _, err := t.tx.ExecContext(dctx, "SAVEPOINT "+savepointName); err != nil {
		return fmt.Errorf("sqlstore: savepoint: %w", err)
	}
	t.saved = true
	return nil
}

// Healthy reports whether the batch's transaction is open and not aborted, sending nothing:
// on PostgreSQL from the connection's transaction status; on MySQL, where a failed statement
// does not abort the transaction, it only knows whether the batch has ended (Commit checks
// @@in_transaction).
func (t *batchTx) Healthy() error {
	if t.ended {
		return errors.New("sqlstore: the batch has ended")
	}
	if t.se.s.d.sessionLock {
		return nil
	}
	var status byte
	closed := false
	_ = t.se.conn.Raw(func(dc any) error {
		if c, ok := dc.(*stdlib.Conn); ok {
			status, closed = c.Conn().PgConn().TxStatus(), c.Conn().IsClosed()
		}
		return nil
	})
	switch {
	case closed:
		return fmt.Errorf("%w: its connection is closed (%w)", contract.ErrTxEnded, contract.ErrCommitRolledBack)
	case status == 'I':
		return fmt.Errorf("%w: a COMMIT or ROLLBACK statement ran (%w)", contract.ErrTxEnded, contract.ErrCommitRolledBack)
	case status == 'E':
		return errSwallowed
	}
	return nil
}

// Drop takes member k out of the batch: f is recorded first (on a second connection, while
// the batch still holds the key), then, with a savepoint open, ROLLBACK TO SAVEPOINT, the
// claim's DELETE and RELEASE SAVEPOINT; without one, the claim's DELETE (nothing when the
// transaction is not healthy: the caller rolls the batch back).
func (t *batchTx) Drop(ctx context.Context, k int, f contract.Failure) (int, error) {
	if k < 0 || k >= len(t.members) || !t.members[k].in {
		return 0, fmt.Errorf("sqlstore: drop: no member %d in the batch", k)
	}
	m := &t.members[k]
	m.in = false
	n, rerr := t.recordMember(ctx, k, f)
	if t.ended {
		return n, rerr
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.se.finish)
	defer cancel()
	drop := t.se.s.q.dropClaim
	switch {
	case t.saved:
		for _, q := range []string{"ROLLBACK TO SAVEPOINT " + savepointName, drop.sql, "RELEASE SAVEPOINT " + savepointName} {
			var err error
			if q == drop.sql {
				_, err = drop.exec(dctx, t.tx, keyArgs(m.key))
			} else {
				_, err = t.tx.ExecContext(dctx, q)
			}
			if err != nil {
				return n, errors.Join(rerr, fmt.Errorf("sqlstore: drop a member: %w", err))
			}
		}
		t.saved = false
	case t.Healthy() == nil:
		if _, err := drop.exec(dctx, t.tx, keyArgs(m.key)); err != nil {
			return n, errors.Join(rerr, fmt.Errorf("sqlstore: drop a member: %w", err))
		}
	}
	return n, rerr
}

// recordMember records member k's failure f now, or, when no second connection is free, once
// the batch has ended.
func (t *batchTx) recordMember(ctx context.Context, k int, f contract.Failure) (int, error) {
	m := &t.members[k]
	delta := b2i(f.Counts) - b2i(m.counted)
	m.counted = false
	if !t.counting || (delta == 0 && !f.Counts) {
		return 0, nil
	}
	errText := ""
	if f.Counts {
		errText = f.Error
	}
	s := t.se.s
	estimate := max(m.attempts+b2i(f.Counts), 0)
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.se.finish)
	defer cancel()
	actx, acancel := context.WithTimeout(dctx, min(t.se.finish, failAcquireTimeout))
	conn, err := s.db.Conn(actx)
	acancel()
	if err != nil {
		t.pending = append(t.pending, settle{k: k, delta: delta, err: errText})
		return estimate, nil
	}
	defer func() { _ = conn.Close() }()
	n, err := s.record(dctx, conn, m.key, delta, errText)
	if err != nil {
		return estimate, fmt.Errorf("sqlstore: record the failure: %w", err)
	}
	return n, nil
}

// Commit commits every member still in the batch (after the same check as a single claim's
// Commit), releases the keys' locks (MySQL) and clears the attempt records of the members
// that may have one. A rollback certain at COMMIT takes the members' counts back.
func (t *batchTx) Commit(ctx context.Context) error {
	if t.ended {
		return nil
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.se.finish)
	defer cancel()
	if err := t.se.txEnded(dctx, t.tx); err != nil {
		_ = t.Rollback(ctx)
		return err
	}
	err := t.tx.Commit()
	if err != nil && !serverError(err) && !errors.Is(err, sql.ErrTxDone) {
		t.se.bad = true
		t.end(ctx, true)
		return err // the outcome is unknown
	}
	t.end(ctx, true)
	if err != nil {
		t.takeBack(dctx, true)
		return commitErr(err)
	}
	for _, m := range t.members {
		if m.dirty {
			_, _ = t.se.s.q.clearProcessed.exec(dctx, t.se.s.db, keyArgs(m.key))
		}
	}
	t.takeBack(dctx, false) // committed: only the pending records of dropped members
	return nil
}

// Rollback rolls the batch back, then writes the records Drop left pending and takes back the
// counts of the members still in the batch that were counted.
func (t *batchTx) Rollback(ctx context.Context) error {
	if t.ended {
		return nil
	}
	t.end(ctx, false)
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.se.finish)
	defer cancel()
	t.takeBack(dctx, true)
	return nil
}

// takeBack writes the pending records and, with members, takes back the counts of the members
// still in the batch. Best effort: a failure leaves one count too many for a message, the
// cost of a crash at the same point.
func (t *batchTx) takeBack(ctx context.Context, members bool) {
	ps := t.pending
	t.pending = nil
	if members {
		for k, m := range t.members {
			if m.in && m.counted {
				ps = append(ps, settle{k: k, delta: -1})
			}
		}
	}
	for _, p := range ps {
		_, _ = t.se.s.record(ctx, t.se.s.db, t.members[p.k].key, p.delta, p.err)
	}
}
