package pgstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/pgtx"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// savepointName is the one savepoint name of a batch (Savepoint reuses it).
const savepointName = "inbox_member"

// errSwallowed is Healthy's error when a statement of a member's handler failed although the
// handler returned nil: the transaction is aborted (COMMIT would answer ROLLBACK).
var errSwallowed = errors.New("pgstore: a statement of the handler failed but the handler returned nil; the transaction is aborted")

// ClaimBatch claims the keys of ds in one transaction (the inbox's batched mode, group
// commit), with the single claim's statements pipelined member by member, in one round trip:
//
//	BEGIN ISOLATION LEVEL ...; [the local timeouts;] per member: queries/claim.sql [, queries/record.sql]
//
// (counting under REPEATABLE READ or SERIALIZABLE, after every member's queries/lock_session.sql
// in a READ COMMITTED transaction of its own, as a single claim does) and decides for each (contract.Decide). A second round trip, only when a member was not
// run, reads the stored payload hashes of the members not inserted (queries/stored_hash.sql)
// and takes the claims of claimed members that are not to run out of the transaction
// (queries/drop_claim.sql). A member whose key a delivery in flight holds is decided RunAlone:
// the inbox claims it alone, where the claim waits for the key. The members that count first
// are counted together (count.go) before their handlers run.
func (s *Store) ClaimBatch(ctx context.Context, ds []contract.Delivery) (contract.BatchTx, []contract.Claim, error) {
	t, err := s.newBatch(ctx, ds)
	if err != nil {
		return nil, nil, err
	}
	claims, err := t.claim(ctx, ds)
	if err != nil {
		_ = t.end(ctx, func(ctx context.Context) error {
			_, _ = t.conn.Exec(ctx, "rollback")
			return nil
		})
		return nil, nil, fmt.Errorf("pgstore: batch claim: %w", err)
	}
	if err := t.countFirst(ctx, ds, claims); err != nil {
		_ = t.Rollback(ctx)
		return nil, nil, fmt.Errorf("pgstore: batch claim: count the attempts: %w", err)
	}
	return t, claims, nil
}

// newBatch checks ds and opens the batch's connection.
func (s *Store) newBatch(ctx context.Context, ds []contract.Delivery) (*batchTx, error) {
	if len(ds) == 0 {
		return nil, fmt.Errorf("%w: pgstore: empty batch", inbox.ErrInvalidConfig)
	}
	lvl, err := isoLevel(ds[0].Isolation)
	if err != nil {
		return nil, err
	}
	t := &batchTx{periods: make([]time.Time, len(ds)), members: make([]member, len(ds))}
	seen := make(map[string]bool, len(ds))
	for k, d := range ds {
		if d.Key.ConsumerName != ds[0].Key.ConsumerName || seen[d.Key.MessageID] {
			return nil, fmt.Errorf("%w: pgstore: a batch holds distinct keys of one consumer", inbox.ErrInvalidConfig)
		}
		seen[d.Key.MessageID] = true
		if t.periods[k], err = s.period(d); err != nil {
			return nil, err
		}
		t.members[k].key = d.Key
	}
	if err := s.registerConsumer(ctx, ds[0].Key.ConsumerName); err != nil {
		return nil, err
	}
	conn, err := s.acquire(ctx)
	if err != nil {
		return nil, err
	}
	t.claimTx = claimTx{s: s, conn: conn, finish: finishTimeout(ds[0].FinishTimeout), counting: ds[0].MaxAttempts > 0}
	t.iso = lvl
	return t, nil
}

// claim sends the claims and decides for every member; members not to run are out of the
// transaction when it returns.
func (t *batchTx) claim(ctx context.Context, ds []contract.Delivery) ([]contract.Claim, error) {
	s := t.s
	claimed := make([]bool, len(ds))
	recs := make([]contract.Record, len(ds))
	b := &pgx.Batch{}
	locked := t.begin(b, ds)
	preLock := locked != nil
	s.queueTimeouts(b)
	claimQ := s.q.claim
	if t.counting {
		// The keys' locks for the session, as a single counting claim takes its own: a failed
		// statement of a member's handler aborts the batch's transaction, which would release
		// transaction-level locks at once, before the members' failures are recorded. Every
		// one is released when the batch ends (claimTx.end, commitWith).
		claimQ, t.sessionAll = s.q.claimSession, true
	}
	for k, d := range ds {
		b.Queue(claimQ.sql, claimQ.args(s.claimArgs(d, t.periods[k]))...).Exec(func(ct pgconn.CommandTag) error {
			claimed[k] = ct.RowsAffected() == 1
			return nil
		})
		if t.counting {
			b.Queue(s.q.record.sql, s.q.record.args(keyArgs(d.Key, t.periods[k]))...).QueryRow(func(row pgx.Row) error {
				return scanRecord(row, &recs[k])
			})
		}
	}
	if err := s.sendClaim(ctx, t.conn, b, &t.claimTx); err != nil {
		return nil, s.wrapNoPartition(err, t.periods[0])
	}
	late := make([]bool, len(ds)) // claimed, but after a lock held when tried ahead
	for k := range ds {
		if preLock && claimed[k] && !locked[k] {
			late[k], claimed[k] = true, false
		}
	}
	t.h = &handlerTx{Tx: t.tx}
	claims := make([]contract.Claim, len(ds))
	stored := make([][]byte, len(ds))
	storedAt := make([]time.Time, len(ds))
	held := make([]bool, len(ds))
	b = &pgx.Batch{}
	for k, d := range ds {
		m := &t.members[k]
		if late[k] {
			b.Queue(s.q.dropClaim.sql, s.q.dropClaim.args(keyArgs(d.Key, t.periods[k]))...)
			continue
		}
		if !claimed[k] {
			b.Queue(s.q.storedHash.sql, s.q.storedHash.args(keyArgs(d.Key, t.periods[k]))...).QueryRow(func(row pgx.Row) error {
				err := s.scanHash(row, &stored[k], &storedAt[k])
				if errors.Is(err, pgx.ErrNoRows) {
					held[k] = true
					return nil
				}
				return err
			})
			m.dirty = t.counting // a processed key's record is stale: cleared after COMMIT
			continue
		}
		claims[k] = contract.Decide(d, true, nil, recs[k])
		m.attempts = claims[k].Attempts
		if claims[k].Decision != contract.Run {
			b.Queue(s.q.dropClaim.sql, s.q.dropClaim.args(keyArgs(d.Key, t.periods[k]))...)
			continue
		}
		m.in = true
		m.dirty = t.counting && (recs[k].Attempts > 0 || recs[k].LastError != "" || t.iso != pgx.ReadCommitted)
	}
	if b.Len() > 0 {
		if err := t.conn.Conn().SendBatch(ctx, b).Close(); err != nil {
			return nil, err
		}
	}
	for k, d := range ds {
		switch {
		case claimed[k]:
		case held[k] || late[k]:
			claims[k] = contract.Claim{Decision: contract.RunAlone}
		default:
			claims[k] = contract.Decide(d, false, stored[k], contract.Record{})
			claims[k].StoredAt = storedAt[k]
		}
	}
	return claims, nil
}

// begin queues the batch's BEGIN on b. Counting under REPEATABLE READ or SERIALIZABLE, the
// keys' locks are taken for the session first, in a READ COMMITTED transaction of their own,
// as a single claim takes its key's (claimBatch), so that the batch's snapshot, taken at its
// first claim, is later than every member's lock: a snapshot taken before a member's lock
// could miss the attempt record the delivery that held the key committed just before
// releasing it. It then returns where each lock's answer goes (nil otherwise); a member whose
// lock was held then is decided RunAlone even if its claim took the lock later, and its key
// stays locked until the batch ends: the dropped claim's row is the batch transaction's until
// then, so a claim of the key would wait for it on the server, while a held lock makes it wait
// in process, without a connection (TestBatchLateMemberIsHeldUntilTheBatchEnds).
func (t *batchTx) begin(b *pgx.Batch, ds []contract.Delivery) []bool {
	if !t.counting || t.iso == pgx.ReadCommitted {
		b.BeginTx(pgx.TxOptions{IsoLevel: t.iso})
		return nil
	}
	s := t.s
	locked := make([]bool, len(ds))
	b.BeginTx(pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	for k, d := range ds {
		b.Queue(s.q.lockSession.sql, s.q.lockSession.args(&queryArgs{lockKey: s.lockKey(d.Key)})...).QueryRow(func(row pgx.Row) error {
			return row.Scan(&locked[k])
		})
	}
	b.Queue("commit")
	b.Queue(beginSQL(t.iso))
	return locked
}

// countFirst counts, in one request, the members to run that count first.
func (t *batchTx) countFirst(ctx context.Context, ds []contract.Delivery, claims []contract.Claim) error {
	var keys []inbox.Key
	var idx []int
	for k, d := range ds {
		if t.counting && d.CountFirst && claims[k].Decision == contract.Run {
			keys, idx = append(keys, d.Key), append(idx, k)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	counts, err := t.s.counter.count(ctx, keys, t.finish)
	if err != nil {
		// Still holding the keys: counts that committed unseen are taken back first.
		periods, before := make([]time.Time, len(idx)), make([]int, len(idx))
		for j, k := range idx {
			periods[j], before[j] = t.periods[k], claims[k].Attempts
		}
		return t.s.counter.undoUnknown(ctx, err, keys, periods, before, t.finish)
	}
	b := &pgx.Batch{}
	for j, k := range idx {
		m := &t.members[k]
		if counts[j] < 0 { // dead-lettered since the record was read
			claims[k].Decision = contract.DeadLettered
			m.in = false
			b.Queue(t.s.q.dropClaim.sql, t.s.q.dropClaim.args(keyArgs(m.key, t.periods[k]))...)
			continue
		}
		m.counted, m.dirty = true, true
	}
	if b.Len() == 0 {
		return nil
	}
	return t.conn.Conn().SendBatch(ctx, b).Close()
}

// member is one delivery of a batch, as the store keeps it.
type member struct {
	key      inbox.Key
	in       bool // the transaction holds its claim
	counted  bool // counted before its handler, count not yet settled
	attempts int  // earlier attempts, as the claim found them
	dirty    bool // its attempt record may need clearing after COMMIT
}

// batchTx is the transaction of a batch, on one connection acquired for it.
type batchTx struct {
	claimTx // the connection, the pgx transaction, the finish timeout
	iso     pgx.TxIsoLevel
	periods []time.Time // the members' partition periods (partitioned mode)
	members []member
	saved   bool // a savepoint is open
}

func (t *batchTx) Context(ctx context.Context) context.Context {
	return pgtx.With(ctx, t.h)
}

// Savepoint marks the point Drop rolls back to: SAVEPOINT, after releasing the open one, in
// one round trip.
func (t *batchTx) Savepoint(ctx context.Context) error {
	if t.ended {
		return errors.New("pgstore: savepoint: the batch has ended")
	}
	q := "savepoint " + savepointName
	if t.saved {
		q = "release savepoint " + savepointName + "; " + q
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.finish)
	defer cancel()
	if _, err := t.conn.Exec(dctx, q); err != nil {
		return fmt.Errorf("pgstore: savepoint: %w", err)
	}
	t.saved = true
	return nil
}

// Healthy reports, from the connection's transaction status (which the server sends after
// every statement: no round trip), whether the batch's transaction is open and not aborted.
func (t *batchTx) Healthy() error {
	if t.ended {
		return errors.New("pgstore: the batch has ended")
	}
	if err := t.h.endedOn(t.conn); err != nil {
		return err
	}
	if t.conn.Conn().PgConn().TxStatus() == 'E' {
		return errSwallowed
	}
	return nil
}

// Drop takes member k out of the batch: f is recorded first (on a second pool connection,
// while the batch still holds the key's lock, so the key's next delivery reads it), then, with
// a savepoint open, ROLLBACK TO SAVEPOINT, the claim's DELETE and RELEASE SAVEPOINT; without
// one, the claim's DELETE (nothing when the transaction is aborted: the caller rolls the batch
// back).
func (t *batchTx) Drop(ctx context.Context, k int, f contract.Failure) (int, error) {
	if k < 0 || k >= len(t.members) || !t.members[k].in {
		return 0, fmt.Errorf("pgstore: drop: no member %d in the batch", k)
	}
	m := &t.members[k]
	m.in = false
	n, rerr := t.recordMember(ctx, k, f)
	if t.ended {
		return n, rerr
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.finish)
	defer cancel()
	drop := t.s.q.dropClaim
	switch {
	case t.h.endedOn(t.conn) != nil:
		return n, rerr
	case t.saved:
		// First on its own: a statement is not even parsed in an aborted transaction.
		if _, err := t.conn.Exec(dctx, "rollback to savepoint "+savepointName); err != nil {
			return n, errors.Join(rerr, fmt.Errorf("pgstore: drop a member: %w", err))
		}
		b := &pgx.Batch{}
		b.Queue(drop.sql, drop.args(keyArgs(m.key, t.periods[k]))...)
		b.Queue("release savepoint " + savepointName)
		t.saved = false
		if err := t.conn.Conn().SendBatch(dctx, b).Close(); err != nil {
			return n, errors.Join(rerr, fmt.Errorf("pgstore: drop a member: %w", err))
		}
	case t.conn.Conn().PgConn().TxStatus() == 'T':
		if _, err := t.conn.Exec(dctx, drop.sql, drop.args(keyArgs(m.key, t.periods[k]))...); err != nil {
			return n, errors.Join(rerr, fmt.Errorf("pgstore: drop a member: %w", err))
		}
	}
	return n, rerr
}

// recordMember records member k's failure f on the store's count connection (count.go), while
// the batch still holds the key.
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
	n, err := t.s.counter.record(m.key, t.periods[k], delta, errText, t.finish)
	if err != nil {
		return max(m.attempts+b2i(f.Counts), 0), fmt.Errorf("pgstore: record the failure: %w", err)
	}
	return n, nil
}

// Commit commits every member still in the batch (after the same check as a single claim's
// Commit) and, in the same round trip, clears the attempt records of the members that may
// have one (queries/clear_processed.sql, placed as claimTx.Commit places it). A rollback certain at COMMIT takes the members'
// counts back, as Rollback does. Errors mean what a single claim's Commit errors mean.
func (t *batchTx) Commit(ctx context.Context) error {
	if t.ended {
		return nil
	}
	if err := t.h.endedOn(t.conn); err != nil {
		_ = t.Rollback(ctx)
		return err
	}
	return t.end(ctx, func(ctx context.Context) error {
		var clear []clearKey
		for k, m := range t.members {
			if m.dirty {
				clear = append(clear, clearKey{m.key, t.periods[k]})
			}
		}
		err := t.s.commitWith(ctx, t.conn, t.iso, clear, release{all: t.sessionAll})
		if err == nil {
			t.sessionAll = false // released in COMMIT's round trip
		}
		switch {
		case err == nil:
		case errors.Is(err, contract.ErrCommitRolledBack):
			t.takeBack(ctx, true)
		}
		return err
	})
}

// Rollback rolls the batch back, then takes back the counts of the members still in the batch
// that were counted.
func (t *batchTx) Rollback(ctx context.Context) error {
	return t.end(ctx, func(ctx context.Context) error {
		err := t.rollback(ctx)
		t.takeBack(ctx, true)
		return err
	})
}

// takeBack takes back, with members, the counts of the members still in the batch that were
// counted, on the store's count connection (count.go). Best effort: a failure leaves one count
// too many for a message, the cost of a crash at the same point.
func (t *batchTx) takeBack(_ context.Context, members bool) {
	if !members {
		return
	}
	for k, m := range t.members {
		if m.in && m.counted {
			_, _ = t.s.counter.record(m.key, t.periods[k], -1, "", t.finish)
		}
	}
}
