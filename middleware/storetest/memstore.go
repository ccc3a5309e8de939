package storetest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// ErrConflict is the transient conflict of MemStore: a handler that returns it (or an error
// wrapping it) simulates a serialization failure, which MemStore.Retryable reports.
var ErrConflict = errors.New("storetest: simulated serialization failure")

// MemStore is the in-memory reference store: it implements inbox.Store, inbox.AttemptStore
// and inbox.Purger with the semantics the conformance suite demands of a database (a claim
// of a key held by an open transaction waits for it; a rollback leaves no mark; attempt
// records survive rollbacks and are restored additively), and passes the suite. It keeps
// everything in process memory, so it proves the contract can be implemented without
// touching the core, and lets the middleware's own tests run without a database. It
// guarantees nothing across processes or crashes: never use it in production.
//
// Business state lives in a small key-value map of integers: a handler reaches its
// transaction with MemTxFromContext and calls Add; Value reads what committed.
type MemStore struct {
	mu       sync.Mutex
	wake     chan struct{} // closed and replaced on every change
	rows     map[inbox.Key]memRow
	held     map[inbox.Key]*MemTx
	records  map[inbox.Key]inbox.AttemptRecord
	counting map[inbox.Key]bool // keys whose counted delivery holds the count lock
	values   map[string]int64
	now      func() time.Time
}

type memRow struct {
	hash       []byte
	receivedAt time.Time
}

var (
	_ inbox.Store        = (*MemStore)(nil)
	_ inbox.AttemptStore = (*MemStore)(nil)
	_ inbox.Purger       = (*MemStore)(nil)
)

// NewMemStore returns an empty MemStore.
func NewMemStore() *MemStore {
	return &MemStore{
		wake:     make(chan struct{}),
		rows:     map[inbox.Key]memRow{},
		held:     map[inbox.Key]*MemTx{},
		records:  map[inbox.Key]inbox.AttemptRecord{},
		counting: map[inbox.Key]bool{},
		values:   map[string]int64{},
		now:      time.Now,
	}
}

// changed wakes every waiter. s.mu must be held.
func (s *MemStore) changed() {
	close(s.wake)
	s.wake = make(chan struct{})
}

// wait releases s.mu until the next change or ctx's end, then takes it again.
func (s *MemStore) wait(ctx context.Context) error {
	w := s.wake
	s.mu.Unlock()
	defer s.mu.Lock()
	select {
	case <-w:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Value returns the committed value of a business key (0 when never written).
func (s *MemStore) Value(name string) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.values[name]
}

// Processed reports whether key's claim is committed.
func (s *MemStore) Processed(key inbox.Key) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.rows[key]
	return ok
}

// Records returns a copy of the committed attempt records.
func (s *MemStore) Records() map[inbox.Key]inbox.AttemptRecord {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.records)
}

// SetClock replaces the clock that stamps claims (for Purge tests).
func (s *MemStore) SetClock(now func() time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.now = now
}

// Retryable implements inbox.Store: errors wrapping ErrConflict.
func (s *MemStore) Retryable(err error) bool { return errors.Is(err, ErrConflict) }

// Claim implements inbox.Store.
func (s *MemStore) Claim(ctx context.Context, p inbox.ClaimParams) (inbox.Tx, inbox.ClaimResult, error) {
	tx, res, err := s.claim(ctx, inbox.CountedClaimParams{ClaimParams: p}, false)
	if tx == nil {
		return nil, res.ClaimResult, err
	}
	return tx, res.ClaimResult, nil
}

// ClaimCounted implements inbox.AttemptStore.
func (s *MemStore) ClaimCounted(ctx context.Context, p inbox.CountedClaimParams) (inbox.CountedTx, inbox.CountedClaimResult, error) {
	tx, res, err := s.claim(ctx, p, true)
	if tx == nil {
		return nil, res, err
	}
	return tx, res, nil
}

func (s *MemStore) claim(ctx context.Context, p inbox.CountedClaimParams, counted bool) (*MemTx, inbox.CountedClaimResult, error) {
	var res inbox.CountedClaimResult
	switch p.Isolation {
	case sql.LevelDefault, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable:
	default:
		return nil, res, fmt.Errorf("%w: storetest: isolation level %s is not supported", inbox.ErrInvalidConfig, p.Isolation)
	}
	if err := ctx.Err(); err != nil {
		return nil, res, err
	}
	k := p.Key
	s.mu.Lock()
	defer s.mu.Unlock()
	tx := &MemTx{s: s, key: k, hash: p.PayloadHash, writes: map[string]int64{}}
	if counted {
		// Every counted claim takes the key's count lock (pgstore: a session lock when it
		// counts first, a transaction lock otherwise), so no copy counts while it runs.
		for s.counting[k] {
			if err := s.wait(ctx); err != nil {
				return nil, res, err
			}
		}
		s.counting[k] = true
		tx.locked = true
	}
	if counted && p.CountFirst {
		if _, done := s.rows[k]; !done && !s.records[k].DeadLettered && (p.CountLimit <= 0 || s.records[k].Attempts < p.CountLimit) {
			r := s.records[k]
			r.Attempts++
			s.records[k] = r
			res.Counted = true
		}
	}
	for s.held[k] != nil {
		if err := s.wait(ctx); err != nil {
			tx.release(res.Counted)
			return nil, inbox.CountedClaimResult{}, err
		}
	}
	if row, done := s.rows[k]; done {
		res.StoredPayloadHash = row.hash
		if counted {
			if r := s.records[k]; !r.DeadLettered {
				delete(s.records, k)
			}
		}
		tx.release(false)
		return nil, res, nil
	}
	res.Claimed = true
	if counted && p.NoRecord && !p.CountFirst {
		tx.counted = true
		tx.noRecord = true
	} else if counted {
		rec := s.records[k]
		res.Record = rec
		tx.counted = true
		if rec.DeadLettered {
			res.Claimed = false
			tx.release(false)
			return nil, res, nil
		}
	}
	s.held[k] = tx
	return tx, res, nil
}

// AdjustAttempts implements inbox.AttemptStore.
func (s *MemStore) AdjustAttempts(ctx context.Context, p inbox.AttemptParams) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.changed()
	return s.adjust(p.Key, p.AttemptsDelta, p.Error), nil
}

// adjust adds delta to k's attempt record (never below 0; a positive delta creates it
// unless k is processed) and stores errText when non-empty; it returns the count. s.mu must
// be held.
func (s *MemStore) adjust(k inbox.Key, delta int, errText string) int {
	r, ok := s.records[k]
	if r.DeadLettered {
		return 0
	}
	if _, done := s.rows[k]; (done && delta > 0) || (!ok && delta <= 0) {
		return 0 // as pgstore: a processed key is not counted
	}
	r.Attempts = max(r.Attempts+delta, 0)
	if errText != "" {
		r.LastError = errText
	}
	if r.Attempts == 0 && r.LastError == "" {
		delete(s.records, k)
		return 0
	}
	s.records[k] = r
	return r.Attempts
}

// MarkDeadLettered implements inbox.AttemptStore.
func (s *MemStore) MarkDeadLettered(ctx context.Context, p inbox.AttemptParams) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.changed()
	r := s.records[p.Key]
	r.DeadLettered, r.DeadLetterReason = true, p.Error
	s.records[p.Key] = r
	return nil
}

// Replay implements inbox.AttemptStore.
func (s *MemStore) Replay(ctx context.Context, p inbox.AttemptParams) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.changed()
	if !s.records[p.Key].DeadLettered {
		return false, nil
	}
	delete(s.records, p.Key)
	_, processed := s.rows[p.Key] // processed since its dead letter: not replayed (as pgstore)
	return !processed, nil
}

// Purge implements inbox.Purger. It deletes in one batch per call of BatchSize rows.
func (s *MemStore) Purge(ctx context.Context, p inbox.PurgeParams) (inbox.PurgeResult, error) {
	var res inbox.PurgeResult
	size := p.BatchSize
	if size <= 0 {
		size = 5000
	}
	for {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		s.mu.Lock()
		n := 0
		for k, row := range s.rows {
			if n == size {
				break
			}
			if row.receivedAt.Before(p.Before) && (p.ConsumerName == "" || k.ConsumerName == p.ConsumerName) {
				delete(s.rows, k)
				if s.records[k].DeadLettered {
					delete(s.records, k) // moot: processed after its dead letter (as pgstore)
				}
				n++
			}
		}
		s.changed()
		s.mu.Unlock()
		res.Batches++
		res.Deleted += int64(n)
		if n < size {
			return res, nil
		}
	}
}

type memTxKey struct{}

// MemTxFromContext returns the MemStore transaction of the delivery whose context is ctx (the
// handler's msg.Context()), and false outside one.
func MemTxFromContext(ctx context.Context) (*MemTx, bool) {
	tx, ok := ctx.Value(memTxKey{}).(*MemTx)
	return tx, ok
}

// MemTx is an open MemStore claim transaction. Its Add calls take effect at Commit.
type MemTx struct {
	s       *MemStore
	key     inbox.Key
	hash    []byte
	writes  map[string]int64
	counted bool // a counted claim: its commit clears the attempt record (unless noRecord)
	// noRecord: claimed with NoRecord, the record neither read nor cleared.
	noRecord bool
	locked   bool // holds the key's count lock
	ended    bool
}

// Add adds delta to the business value name, in the transaction.
func (t *MemTx) Add(name string, delta int64) {
	t.s.mu.Lock()
	defer t.s.mu.Unlock()
	t.writes[name] += delta
}

// Context implements inbox.Tx.
func (t *MemTx) Context(ctx context.Context) context.Context {
	return context.WithValue(ctx, memTxKey{}, t)
}

// release ends the transaction's hold on its key and count lock. uncount takes back a
// count made by this claim. t.s.mu must be held.
func (t *MemTx) release(uncount bool) {
	k := t.key
	if t.s.held[k] == t {
		delete(t.s.held, k)
	}
	if uncount {
		t.s.adjust(k, -1, "")
	}
	if t.locked {
		delete(t.s.counting, k)
		t.locked = false
	}
	t.ended = true
	t.s.changed()
}

// Commit implements inbox.Tx: the claim and the Add calls become visible at once.
func (t *MemTx) Commit(context.Context) error {
	t.s.mu.Lock()
	defer t.s.mu.Unlock()
	if t.ended {
		return nil
	}
	t.s.rows[t.key] = memRow{hash: t.hash, receivedAt: t.s.now()}
	for name, d := range t.writes {
		t.s.values[name] += d
	}
	if t.counted && !t.noRecord && !t.s.records[t.key].DeadLettered {
		delete(t.s.records, t.key)
	}
	t.release(false)
	return nil
}

// Rollback implements inbox.Tx.
func (t *MemTx) Rollback(context.Context) error {
	t.s.mu.Lock()
	defer t.s.mu.Unlock()
	if !t.ended {
		t.release(false)
	}
	return nil
}

// Fail implements inbox.CountedTx: the record is updated and the claim released at once.
func (t *MemTx) Fail(_ context.Context, p inbox.FailParams) (int, error) {
	t.s.mu.Lock()
	defer t.s.mu.Unlock()
	if t.ended {
		return 0, nil
	}
	n := t.s.adjust(t.key, p.AttemptsDelta, p.Error)
	t.release(false)
	return n, nil
}
