package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

var _ inbox.BatchStore = (*Store)(nil)

// savepointName is the one savepoint name of a batch (BatchTx.Savepoint reuses it).
const savepointName = "inbox_member"

// batchSQL holds the statements of ClaimBatch, built from the store's quoted names and its
// layout. Keys travel as arrays ($1: message IDs, in the batch's order; $2: the consumer name;
// in partitioned mode the periods, in the same order, as the last parameter).
type batchSQL struct {
	lock, count, claim, claimCounted, records, hashes, clear, drop string
	// tryClaim is claim with each key's transaction-level advisory lock tried first
	// (pg_try_advisory_xact_lock on the lock key: the parameter after the claim's, the prefix
	// table, unit separator, consumer name, unit separator; then the message ID): a key held
	// by a delivery in flight is not inserted, and waits for nothing. The uncounted batch's
	// claim under the default ClaimLockTimeout.
	tryClaim string
}

// batchKeyOn is the predicate that a row t of the inbox table holds the key of message ID id
// (a text expression) for the consumer $2, in the period p when partitioned.
func (s *Store) batchKeyOn(id, p string) string {
	m := "t.message_id = " + id + " AND t.consumer_name = $2::text"
	if s.cfg.Layout == LayoutCompact {
		m = "t.message_id = (" + id + ")::uuid AND t.consumer_id = " + s.consumerIDSQL("$2::text")
	}
	if s.cfg.Partitioning != nil {
		m += " AND t.period = " + p
	}
	return m
}

func (s *Store) batchSQL() batchSQL {
	part := s.cfg.Partitioning != nil
	// The keys with their periods: unnest($1 ids[, $n periods]) AS u(k[, p]).
	keys := func(n int) string {
		if part {
			return fmt.Sprintf("unnest($1::text[], $%d::timestamptz[]) AS u(k, p)", n)
		}
		return "unnest($1::text[]) AS u(k)"
	}
	var claim, conflict string
	var claimParams int // the claim's parameter count plus one: the tried lock's key prefix
	switch {
	case s.cfg.Layout == LayoutCompact && part:
		claim = "INSERT INTO " + s.table + " (message_id, consumer_id, payload_hash, period)" +
			" SELECT u.m::uuid, " + s.consumerIDSQL("$2::text") + ", u.h, u.p FROM unnest($1::text[], $3::smallint[], $4::timestamptz[]) AS u(m, h, p)"
		conflict = "message_id, consumer_id, period"
		claimParams = 5
	case s.cfg.Layout == LayoutCompact:
		claim = "INSERT INTO " + s.table + " (message_id, consumer_id, payload_hash)" +
			" SELECT u.m::uuid, " + s.consumerIDSQL("$2::text") + ", u.h FROM unnest($1::text[], $3::smallint[]) AS u(m, h)"
		conflict = "message_id, consumer_id"
		claimParams = 4
	case part:
		claim = "INSERT INTO " + s.table + " (message_id, consumer_name, message_type, correlation_id, payload_hash, period)" +
			" SELECT u.m, $2::text, u.ty, u.c, u.h, u.p FROM unnest($1::text[], $3::text[], $4::text[], $5::bytea[], $6::timestamptz[]) AS u(m, ty, c, h, p)"
		conflict = "message_id, consumer_name, period"
		claimParams = 7
	default:
		claim = "INSERT INTO " + s.table + " (message_id, consumer_name, message_type, correlation_id, payload_hash)" +
			" SELECT u.m, $2::text, u.ty, u.c, u.h FROM unnest($1::text[], $3::text[], $4::text[], $5::bytea[]) AS u(m, ty, c, h)"
		conflict = "message_id, consumer_name"
		claimParams = 6
	}
	// The count statement's limit (countLimit), after the keys' parameters.
	limit := "$3"
	if part {
		limit = "$4"
	}
	drop := "DELETE FROM " + s.table + " WHERE " + s.keyMatch
	if part {
		drop += " AND period = $3"
	}
	return batchSQL{
		// Session-level locks on every key, taken in the array's order (unnest keeps it).
		lock: "SELECT pg_advisory_lock(hashtextextended(k, 0)) FROM unnest($1::text[]) AS k",
		count: "INSERT INTO " + s.attempts + " AS a (message_id, consumer_name)" +
			" SELECT u.k, $2::text FROM " + keys(3) +
			" WHERE NOT EXISTS (SELECT 1 FROM " + s.table + " t WHERE " + s.batchKeyOn("u.k", "u.p") + ")" +
			" ON CONFLICT (message_id, consumer_name) DO UPDATE SET attempts = a.attempts + 1, last_attempt_at = now()" +
			" WHERE a.dead_lettered_at IS NULL AND a.attempts < " + limit + "::int RETURNING message_id",
		claim:    claim + " ON CONFLICT (" + conflict + ") DO NOTHING RETURNING message_id::text",
		tryClaim: claim + fmt.Sprintf(" WHERE pg_try_advisory_xact_lock(hashtextextended($%d::text || u.m, 0))", claimParams) + " ON CONFLICT (" + conflict + ") DO NOTHING RETURNING message_id::text",
		claimCounted: claim + " WHERE NOT EXISTS (SELECT 1 FROM " + s.attempts +
			" WHERE message_id = u.m AND consumer_name = $2::text AND dead_lettered_at IS NOT NULL)" +
			" ON CONFLICT (" + conflict + ") DO NOTHING RETURNING message_id::text",
		records: "SELECT message_id, attempts, last_error, dead_lettered_at IS NOT NULL, dead_letter_reason FROM " + s.attempts +
			" WHERE consumer_name = $2 AND message_id = ANY($1::text[])",
		hashes: "SELECT u.k, t.payload_hash FROM " + keys(3) + " JOIN " + s.table + " t ON " + s.batchKeyOn("u.k", "u.p"),
		clear: "DELETE FROM " + s.attempts + " a WHERE a.consumer_name = $2 AND a.message_id = ANY($1::text[]) AND a.dead_lettered_at IS NULL" +
			" AND a.message_id IN (SELECT u.k FROM " + keys(3) + " JOIN " + s.table + " t ON " + s.batchKeyOn("u.k", "u.p") + ")",
		drop: drop,
	}
}

// BatchSupported implements inbox.BatchStore: nil, in every layout and mode.
func (s *Store) BatchSupported() error { return nil }

// ClaimBatch implements inbox.BatchStore. Everything before the first handler travels in one
// pipelined round trip, whatever the batch's size:
//
//   - counted, when a member counts first: BEGIN; SET LOCAL synchronous_commit TO OFF; the
//     local timeouts; pg_advisory_lock on every member's key, in the batch's order (held until
//     the batch ends); one INSERT ... SELECT FROM unnest(...) ON CONFLICT DO UPDATE that
//     counts the members that count first, unless processed; COMMIT;
//   - BEGIN ISOLATION LEVEL ...; the local timeouts; (counted, when no member counted: the
//     locks); one INSERT ... SELECT FROM unnest(...) ON CONFLICT DO NOTHING RETURNING
//     message_id that claims every key (a dead-lettered one excepted); (counted) the members'
//     attempt records.
//
// Duplicates cost one more round trip (their stored payload hashes); the transaction stays
// open for the others. On error the transaction is rolled back, the counts it made taken back
// and the connection released.
//
// A key held by a delivery in flight is waited for as a single claim waits
// (Config.ClaimLockTimeout): uncounted, under the default, each member's key lock is tried in
// the claim statement (batchSQL.tryClaim), and a key neither inserted nor stored was held;
// counted, or with a positive ClaimLockTimeout, the locks and the claim wait up to the short
// lock_timeout (55P03). Either way the batch claim rolls back, takes its counts back,
// releases its connection, and tries again in process, until ctx ends (ErrClaimInFlight).
func (s *Store) ClaimBatch(ctx context.Context, p inbox.BatchClaimParams) (inbox.BatchTx, []inbox.CountedClaimResult, error) {
	if !s.tryLock() && s.claimLockTimeout() == 0 {
		return s.claimBatchOnce(ctx, p)
	}
	var t inbox.BatchTx
	var res []inbox.CountedClaimResult
	err := s.whileHeld(ctx, func() (err error) {
		t, res, err = s.claimBatchOnce(ctx, p)
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	return t, res, nil
}

func (s *Store) claimBatchOnce(ctx context.Context, p inbox.BatchClaimParams) (inbox.BatchTx, []inbox.CountedClaimResult, error) {
	lvl, err := isoLevel(p.Isolation)
	if err != nil {
		return nil, nil, err
	}
	n := len(p.Claims)
	if n == 0 {
		return nil, nil, fmt.Errorf("%w: pgstore: empty batch", inbox.ErrInvalidConfig)
	}
	consumer := p.Claims[0].Key.ConsumerName
	ids := make([]string, n)
	types, corrs := make([]*string, n), make([]*string, n)
	hashes := make([][]byte, n)
	periods := make([]time.Time, n) // partitioned mode
	var countIDs []string
	var countPeriods []time.Time
	seen := make(map[string]bool, n)
	for k, c := range p.Claims {
		if c.Key.ConsumerName != consumer {
			return nil, nil, fmt.Errorf("%w: pgstore: a batch holds keys of one consumer", inbox.ErrInvalidConfig)
		}
		if seen[c.Key.MessageID] {
			return nil, nil, fmt.Errorf("%w: pgstore: a batch holds distinct keys", inbox.ErrInvalidConfig)
		}
		seen[c.Key.MessageID] = true
		// The layout's key rules (a UUID, a producer time), as a single claim checks them.
		if periods[k], err = s.period(c.ClaimParams); err != nil {
			return nil, nil, err
		}
		ids[k] = c.Key.MessageID
		types[k], corrs[k] = strOrNil(c.MessageType), strOrNil(c.CorrelationID)
		hashes[k] = c.PayloadHash
		if p.Counted && c.CountFirst {
			countIDs = append(countIDs, c.Key.MessageID)
			countPeriods = append(countPeriods, periods[k])
		}
	}
	if err := s.registerConsumer(ctx, consumer); err != nil {
		return nil, nil, err
	}
	part := s.cfg.Partitioning != nil
	// keyArgs are the key arrays of the count, hash and clean-up statements.
	keyArgs := func(ids []string, ps []time.Time) []any {
		if part {
			return []any{ids, consumer, ps}
		}
		return []any{ids, consumer}
	}
	var claimArgs []any
	if s.cfg.Layout == LayoutCompact {
		h16 := make([]*int16, n)
		for k, h := range hashes {
			h16[k] = compactHash(h)
		}
		claimArgs = []any{ids, consumer, h16}
	} else {
		claimArgs = []any{ids, consumer, types, corrs, hashes}
	}
	if part {
		claimArgs = append(claimArgs, periods)
	}
	conn, err := s.acquire(ctx)
	if err != nil {
		return nil, nil, err
	}
	t := &batchTx{
		claimTx: claimTx{s: s, conn: conn, finish: p.FinishTimeout, counted: p.Counted, iso: lvl},
		ids:     ids, periods: periods, consumer: consumer, sql: s.batch,
		claimed: make([]bool, n), countedFirst: make([]bool, n), dropped: make([]bool, n),
		recs: make([]inbox.AttemptRecord, n),
	}
	if t.finish <= 0 {
		t.finish = inbox.DefaultFinishTimeout
	}
	lockKeys := make([]string, n)
	for k, id := range ids {
		lockKeys[k] = s.lockKey(inbox.Key{MessageID: id, ConsumerName: consumer})
	}
	index := make(map[string]int, n)
	for k, id := range ids {
		index[id] = k
	}
	locked := func(pgconn.CommandTag) error { t.locked = true; return nil }
	b := &pgx.Batch{}
	if len(countIDs) > 0 {
		b.BeginTx(pgx.TxOptions{})
		b.Queue("set local synchronous_commit to off")
		s.queueTimeouts(b)
		s.queueClaimLockTimeout(b, false)
		b.Queue(t.sql.lock, lockKeys).Exec(locked)
		b.Queue(t.sql.count, append(keyArgs(countIDs, countPeriods), countLimit(p.Claims[0].CountLimit))...).Query(func(rows pgx.Rows) error {
			return scanIDs(rows, func(id string) { t.countedFirst[index[id]] = true })
		})
		b.Queue("commit")
		b.Queue("begin isolation level " + strings.ToLower(string(lvl)))
		s.queueTimeouts(b)
		s.queueClaimLockTimeout(b, true)
	} else {
		b.BeginTx(pgx.TxOptions{IsoLevel: lvl})
		s.queueTimeouts(b)
		if p.Counted || !s.tryLock() {
			s.queueClaimLockTimeout(b, true)
		}
		if p.Counted {
			b.Queue(t.sql.lock, lockKeys).Exec(locked)
		}
	}
	claimSQL := t.sql.claim
	tried := !p.Counted && s.tryLock()
	switch {
	case p.Counted:
		claimSQL = t.sql.claimCounted
	case tried:
		claimSQL, claimArgs = t.sql.tryClaim, append(claimArgs, s.table+"\x1f"+consumer+"\x1f")
	}
	b.Queue(claimSQL, claimArgs...).Query(func(rows pgx.Rows) error {
		return scanIDs(rows, func(id string) { t.claimed[index[id]] = true })
	})
	if p.Counted {
		b.Queue(t.sql.records, ids, consumer).Query(func(rows pgx.Rows) error {
			for rows.Next() {
				var id string
				var attempts int32
				var lastError, reason *string
				var dead bool
				if err := rows.Scan(&id, &attempts, &lastError, &dead, &reason); err != nil {
					return err
				}
				t.recs[index[id]] = inbox.AttemptRecord{Attempts: int(attempts), LastError: deref(lastError), DeadLettered: dead, DeadLetterReason: deref(reason)}
			}
			return rows.Err()
		})
	}
	if !tried {
		s.queueRestoreLockTimeout(b)
	}
	if err := s.sendClaim(ctx, conn, b, &t.claimTx); err != nil {
		if p.Counted {
			// The lock statement takes the keys one by one: when it fails part-way (55P03,
			// 57014, 40P01) the session locks it took stay held through the rollback, so
			// release them in any case.
			t.locked = true
		}
		_ = t.end(ctx, func(ctx context.Context) error {
			_, _ = t.conn.Exec(ctx, "rollback")
			t.takeBack(ctx, false)
			return nil
		})
		return nil, nil, fmt.Errorf("batch claim: %w", err)
	}
	res := make([]inbox.CountedClaimResult, n)
	var dups []string
	var dupPeriods []time.Time
	for k := range ids {
		res[k].Claimed = t.claimed[k]
		res[k].Counted = t.countedFirst[k]
		switch {
		case t.claimed[k]:
			res[k].Record = t.recs[k]
		case t.recs[k].DeadLettered:
			res[k].Record = t.recs[k]
		default:
			dups = append(dups, ids[k])
			dupPeriods = append(dupPeriods, periods[k])
		}
	}
	t.dirty = lvl != pgx.ReadCommitted
	for k := range ids {
		if t.countedFirst[k] || t.recs[k].Attempts > 0 || t.recs[k].LastError != "" {
			t.dirty = true
		}
	}
	if len(dups) > 0 {
		stored := make(map[string]bool, len(dups))
		rows, err := t.tx.Query(ctx, t.sql.hashes, keyArgs(dups, dupPeriods)...)
		if err == nil {
			err = scanRows(rows, func(rows pgx.Rows) error {
				var id string
				var h []byte
				if err := s.scanHash(scanFirst{rows, &id}, &h); err != nil {
					return err
				}
				res[index[id]].StoredPayloadHash = h
				stored[id] = true
				return nil
			})
		}
		if err != nil {
			_ = t.Rollback(ctx)
			return nil, nil, fmt.Errorf("batch claim: read stored payload hashes: %w", err)
		}
		if tried && len(stored) < len(dups) {
			// A key not inserted and not stored: its tried lock was held by a delivery in
			// flight. The whole batch waits and tries again, as after a lock wait (55P03).
			if err := t.Rollback(ctx); err != nil {
				return nil, nil, fmt.Errorf("batch claim: roll back behind a key in flight: %w", err)
			}
			return nil, nil, fmt.Errorf("batch claim: %w", errKeyHeld)
		}
	}
	return t, res, nil
}

// scanFirst is a pgx.Row over a row of two columns whose first goes to id: scanHash scans
// the second, the payload hash, in the layout's type.
type scanFirst struct {
	rows pgx.Rows
	id   *string
}

func (r scanFirst) Scan(dest ...any) error { return r.rows.Scan(append([]any{r.id}, dest...)...) }

func strOrNil(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// scanIDs calls f with each row's one text column.
func scanIDs(rows pgx.Rows, f func(string)) error {
	return scanRows(rows, func(rows pgx.Rows) error {
		var id string
		if err := rows.Scan(&id); err != nil {
			return err
		}
		f(id)
		return nil
	})
}

func scanRows(rows pgx.Rows, f func(pgx.Rows) error) error {
	defer rows.Close()
	for rows.Next() {
		if err := f(rows); err != nil {
			return err
		}
	}
	return rows.Err()
}

// batchTx is the transaction of a batch, on one connection acquired for it. It releases the
// keys' locks and the connection when it ends.
type batchTx struct {
	claimTx // the connection, the pgx transaction, the lock and the finish timeout

	ids          []string
	periods      []time.Time // the members' partition periods (partitioned mode)
	consumer     string
	sql          batchSQL
	claimed      []bool                // the transaction holds the member's claim
	countedFirst []bool                // ClaimBatch counted the member
	dropped      []bool                // Drop took the member out
	recs         []inbox.AttemptRecord // read at the claim
	pending      []inbox.AttemptParams // Drop's records, applied before the locks are released
	savepoint    bool                  // one is open
}

func (t *batchTx) Context(ctx context.Context) context.Context {
	return context.WithValue(ctx, txKey{}, t.tx)
}

// Savepoint implements inbox.BatchTx: SAVEPOINT, after releasing the open one, in one round
// trip.
func (t *batchTx) Savepoint(ctx context.Context) error {
	if t.ended {
		return errors.New("pgstore: savepoint: the batch has ended")
	}
	q := "savepoint " + savepointName
	if t.savepoint {
		q = "release savepoint " + savepointName + "; " + q
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.finish)
	defer cancel()
	if _, err := t.conn.Exec(dctx, q); err != nil {
		return fmt.Errorf("savepoint: %w", err)
	}
	t.savepoint = true
	return nil
}

// Aborted implements inbox.BatchTx from the connection's transaction status, which the
// server reports after every statement (no round trip).
func (t *batchTx) Aborted() bool {
	return !t.ended && t.conn.Conn().PgConn().TxStatus() == 'E'
}

// Drop implements inbox.BatchTx. With a savepoint open: ROLLBACK TO SAVEPOINT, then the
// claim's DELETE and RELEASE SAVEPOINT in one round trip; without one, the claim's DELETE (nothing
// when the transaction is aborted). p is applied to the attempt record after the batch's
// COMMIT or ROLLBACK and before its locks are released; the count returned is the record read
// at the claim plus p.AttemptsDelta, exact because the batch holds the key's lock.
func (t *batchTx) Drop(ctx context.Context, member int, p inbox.FailParams) (int, error) {
	if member < 0 || member >= len(t.ids) || t.dropped[member] {
		return 0, fmt.Errorf("pgstore: drop: no member %d in the batch", member)
	}
	t.dropped[member] = true
	key := inbox.Key{MessageID: t.ids[member], ConsumerName: t.consumer}
	attempts := 0
	if t.counted {
		attempts = max(t.recs[member].Attempts+p.AttemptsDelta, 0)
		if p.AttemptsDelta != 0 || p.Error != "" {
			t.pending = append(t.pending, inbox.AttemptParams{Key: key, AttemptsDelta: p.AttemptsDelta, Error: p.Error})
		}
	}
	if t.ended {
		return attempts, nil
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.finish)
	defer cancel()
	b := &pgx.Batch{}
	switch {
	case t.savepoint:
		// First on its own: a statement is not even parsed in an aborted transaction.
		if _, err := t.conn.Exec(dctx, "rollback to savepoint "+savepointName); err != nil {
			return attempts, fmt.Errorf("drop a member: %w", err)
		}
		b.Queue(t.sql.drop, t.dropArgs(member)...)
		b.Queue("release savepoint " + savepointName)
		t.savepoint = false
	case t.conn.Conn().PgConn().TxStatus() != 'E':
		b.Queue(t.sql.drop, t.dropArgs(member)...)
	default:
		return attempts, nil // aborted: the caller rolls the batch back
	}
	if err := t.conn.Conn().SendBatch(dctx, b).Close(); err != nil {
		return attempts, fmt.Errorf("drop a member: %w", err)
	}
	return attempts, nil
}

// dropArgs are the parameters of the drop statement for member: its key (and period).
func (t *batchTx) dropArgs(member int) []any {
	if t.s.cfg.Partitioning != nil {
		return []any{t.ids[member], t.consumer, t.periods[member]}
	}
	return []any{t.ids[member], t.consumer}
}

// Commit implements inbox.Tx for the batch: COMMIT and, for counted batches whose keys may
// have attempt records, the DELETE of the records of keys now processed, in one round trip
// with the release of the locks when no member left the batch with a record to write. A
// rollback certain at COMMIT takes the members' counts back, as Rollback does. Errors mean
// what claimTx.Commit's mean.
func (t *batchTx) Commit(ctx context.Context) error {
	return t.end(ctx, func(ctx context.Context) error {
		b := &pgx.Batch{}
		var commitTag pgconn.CommandTag
		var commitErr error
		b.Queue("commit").Exec(func(ct pgconn.CommandTag) error { commitTag = ct; return nil })
		if t.counted && t.dirty {
			if t.s.cfg.Partitioning != nil {
				b.Queue(t.sql.clear, t.ids, t.consumer, t.periods)
			} else {
				b.Queue(t.sql.clear, t.ids, t.consumer)
			}
		}
		unlock := t.locked && len(t.pending) == 0
		if unlock {
			b.Queue(unlockSQL).Exec(func(pgconn.CommandTag) error { t.locked = false; return nil })
		}
		err := t.conn.Conn().SendBatch(ctx, b).Close()
		var pgErr *pgconn.PgError
		switch {
		case commitTag.String() == "COMMIT":
			// Committed; a failed clean-up after COMMIT only leaves stale records.
			t.applyPending(ctx)
			return nil
		case commitTag.String() != "":
			commitErr = pgx.ErrTxCommitRollback
		case errors.As(err, &pgErr):
			commitErr = err
		default:
			return err // the outcome is unknown
		}
		t.takeBack(ctx, true)
		return fmt.Errorf("%w: %w", inbox.ErrCommitRolledBack, commitErr)
	})
}

// Rollback implements inbox.Tx for the batch: ROLLBACK, then the records of members that left
// (Drop) and the count taken back for every member still in the batch that ClaimBatch counted,
// before the locks are released.
func (t *batchTx) Rollback(ctx context.Context) error {
	return t.end(ctx, func(ctx context.Context) error {
		_, err := t.conn.Exec(ctx, "rollback")
		t.takeBack(ctx, true)
		return err
	})
}

// takeBack applies the pending records and takes back the counts of members still in the
// batch, on the batch's connection (still holding the keys' locks) or, when it is broken, on
// the pool. Best effort: a failure leaves one count too many for a message, the cost of a
// crash at the same point.
func (t *batchTx) takeBack(ctx context.Context, withPending bool) {
	var ps []inbox.AttemptParams
	if withPending {
		ps = append(ps, t.pending...)
		t.pending = nil
	}
	for k, id := range t.ids {
		if t.countedFirst[k] && !t.dropped[k] {
			ps = append(ps, inbox.AttemptParams{Key: inbox.Key{MessageID: id, ConsumerName: t.consumer}, AttemptsDelta: -1})
		}
	}
	t.apply(ctx, ps)
}

// applyPending applies Drop's records after a COMMIT.
func (t *batchTx) applyPending(ctx context.Context) {
	ps := t.pending
	t.pending = nil
	t.apply(ctx, ps)
}

func (t *batchTx) apply(ctx context.Context, ps []inbox.AttemptParams) {
	for _, p := range ps {
		if t.conn.Conn().IsClosed() {
			_, _ = t.s.adjust(ctx, t.s.pool, p)
		} else if _, err := t.s.adjust(ctx, t.conn, p); err != nil {
			_, _ = t.s.adjust(ctx, t.s.pool, p)
		}
	}
}

// Fail is not part of a batch (members leave it with Drop); it rolls the whole batch back.
func (t *batchTx) Fail(ctx context.Context, _ inbox.FailParams) (int, error) {
	return 0, t.Rollback(ctx)
}
