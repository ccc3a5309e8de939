package storetest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
)

// ErrConflict is MemStore's transient conflict: a handler that returns it (or an error
// wrapping it) simulates a serialization failure, which Classify reports as Retryable.
var ErrConflict = errors.New("storetest: simulated serialization failure")

// ErrConfigFault is MemStore's configuration fault (Classify: ConfigFault), as a missing
// privilege is on PostgreSQL.
var ErrConfigFault = errors.New("storetest: simulated configuration fault")

// MemStore is the in-memory reference store: it implements the contract with the semantics
// the conformance suite demands of a database (a claim of a key held by an open transaction
// waits for it; a rollback leaves no mark; attempt records survive rollbacks), and passes the
// suite. It lets the middleware's own tests run without a database. It guarantees nothing
// across processes or crashes.
//
// Business state lives in a small key-value map of integers: a handler reaches its
// transaction with MemTxFromContext and calls Add; Value reads what committed.
type MemStore struct {
	mu      sync.Mutex
	wake    chan struct{} // closed and replaced on every change
	rows    map[contract.Key]memRow
	held    map[contract.Key]bool
	records map[contract.Key]MemRecord
	values  map[string]int64
}

type memRow struct {
	hash []byte
	at   time.Time
}

// MemRecord is a key's attempt record in a MemStore.
type MemRecord struct {
	Attempts     int
	LastError    string
	DeadLettered bool
	Reason       string
}

var _ contract.Store = (*MemStore)(nil)

// NewMemStore returns an empty MemStore.
func NewMemStore() *MemStore {
	return &MemStore{
		wake:    make(chan struct{}),
		rows:    map[contract.Key]memRow{},
		held:    map[contract.Key]bool{},
		records: map[contract.Key]MemRecord{},
		values:  map[string]int64{},
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
func (s *MemStore) Processed(key contract.Key) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.rows[key]
	return ok
}

// Records returns a copy of the attempt records.
func (s *MemStore) Records() map[contract.Key]MemRecord {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.records)
}

// Check accepts every delivery.
func (s *MemStore) Check(contract.Delivery) error { return nil }

// NeedsProducerTime is false.
func (s *MemStore) NeedsProducerTime() bool { return false }

// RetentionWindow is zero: MemStore has none.
func (s *MemStore) RetentionWindow() time.Duration { return 0 }

// Classify: ErrConflict is Retryable, ErrConfigFault a ConfigFault.
func (s *MemStore) Classify(err error) contract.Class {
	switch {
	case errors.Is(err, ErrConflict):
		return contract.Retryable
	case errors.Is(err, ErrConfigFault):
		return contract.ConfigFault
	}
	return contract.Other
}

func checkIsolation(l sql.IsolationLevel) error {
	switch l {
	case sql.LevelDefault, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable:
		return nil
	}
	return fmt.Errorf("storetest: isolation level %s is not supported", l)
}

// Claim waits while another transaction holds d.Key, then claims it and decides.
func (s *MemStore) Claim(ctx context.Context, d contract.Delivery) (contract.Tx, contract.Claim, error) {
	if err := checkIsolation(d.Isolation); err != nil {
		return nil, contract.Claim{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.held[d.Key] {
		if err := s.wait(ctx); err != nil {
			return nil, contract.Claim{}, err
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, contract.Claim{}, err
	}
	tx, c := s.claimLocked(d)
	if tx == nil {
		return nil, c, nil
	}
	return tx, c, nil
}

// claimLocked claims d.Key, which no transaction holds. s.mu must be held.
func (s *MemStore) claimLocked(d contract.Delivery) (*MemTx, contract.Claim) {
	k := d.Key
	counting := d.MaxAttempts > 0
	if row, done := s.rows[k]; done {
		if counting && !s.records[k].DeadLettered {
			delete(s.records, k) // stale: the key is processed
		}
		c := contract.Decide(d, false, row.hash, contract.Record{})
		c.StoredAt = row.at
		return nil, c
	}
	r := s.records[k]
	c := contract.Decide(d, true, nil, contract.Record{Attempts: r.Attempts, LastError: r.LastError, DeadLettered: r.DeadLettered && counting})
	if c.Decision != contract.Run {
		return nil, c
	}
	tx := &MemTx{s: s, key: k, hash: d.PayloadHash, writes: map[string]int64{}, counting: counting, attempts: c.Attempts}
	if counting && d.CountFirst {
		r.Attempts++
		s.records[k] = r
		tx.counted = true
		tx.attempts++
	}
	s.held[k] = true
	return tx, c
}

// adjust adds delta to k's attempt record (never below 0; a positive delta creates it
// unless k is processed) and stores errText when non-empty; it returns the count. s.mu must
// be held.
func (s *MemStore) adjust(k contract.Key, delta int, errText string) int {
	r, ok := s.records[k]
	if r.DeadLettered {
		return 0
	}
	if _, done := s.rows[k]; (done && delta > 0) || (!ok && delta <= 0) {
		return 0 // a processed key is not counted
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

// MarkDeadLettered records k as dead-lettered with reason.
func (s *MemStore) MarkDeadLettered(ctx context.Context, k contract.Key, reason string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.changed()
	r := s.records[k]
	r.DeadLettered, r.Reason = true, reason
	s.records[k] = r
	return nil
}

// Replay deletes k's dead-lettered record.
func (s *MemStore) Replay(ctx context.Context, k contract.Key) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.changed()
	if !s.records[k].DeadLettered {
		return false, nil
	}
	delete(s.records, k)
	return true, nil
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
	s        *MemStore
	key      contract.Key
	hash     []byte
	writes   map[string]int64
	counting bool
	counted  bool // counted before its handler
	attempts int
	ended    bool
}

// Add adds delta to the business value name, in the transaction.
func (t *MemTx) Add(name string, delta int64) {
	t.s.mu.Lock()
	defer t.s.mu.Unlock()
	t.writes[name] += delta
}

// Context returns ctx carrying t.
func (t *MemTx) Context(ctx context.Context) context.Context {
	return context.WithValue(ctx, memTxKey{}, t)
}

// release ends the transaction's hold on its key. t.s.mu must be held.
func (t *MemTx) release() {
	delete(t.s.held, t.key)
	t.ended = true
	t.s.changed()
}

// Commit makes the claim and the Add calls visible at once and clears the key's record.
func (t *MemTx) Commit(context.Context) error {
	t.s.mu.Lock()
	defer t.s.mu.Unlock()
	if t.ended {
		return nil
	}
	t.s.rows[t.key] = memRow{t.hash, time.Now()}
	for name, d := range t.writes {
		t.s.values[name] += d
	}
	if t.counting && !t.s.records[t.key].DeadLettered {
		delete(t.s.records, t.key)
	}
	t.release()
	return nil
}

// Fail records f and releases the claim at once.
func (t *MemTx) Fail(_ context.Context, f contract.Failure) (int, error) {
	t.s.mu.Lock()
	defer t.s.mu.Unlock()
	if t.ended {
		return t.attempts, nil
	}
	t.attempts = t.s.settle(t.key, t.counting, t.counted, f)
	t.counted = false
	t.release()
	return t.attempts, nil
}

// settle records f for k, counted before its handler or not. s.mu must be held.
func (s *MemStore) settle(k contract.Key, counting, counted bool, f contract.Failure) int {
	if !counting {
		return 0
	}
	errText := ""
	if f.Counts {
		errText = f.Error
	}
	delta := 0
	switch {
	case f.Counts && !counted:
		delta = 1
	case !f.Counts && counted:
		delta = -1
	}
	if delta == 0 && errText == "" {
		return s.records[k].Attempts
	}
	return s.adjust(k, delta, errText)
}
