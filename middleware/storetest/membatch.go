package storetest

import (
	"context"
	"errors"
	"fmt"
	"maps"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

var _ inbox.BatchStore = (*MemStore)(nil)

// BatchSupported returns nil: MemStore claims batches (inbox.BatchStore).
func (s *MemStore) BatchSupported() error { return nil }

// ClaimBatch implements inbox.BatchStore: each key is claimed as Claim (or ClaimCounted)
// would, in the order given, and the batch holds them until it ends. The members' handlers
// write through one MemTx (MemTxFromContext) whose writes take effect at Commit.
func (s *MemStore) ClaimBatch(ctx context.Context, p inbox.BatchClaimParams) (inbox.BatchTx, []inbox.CountedClaimResult, error) {
	if len(p.Claims) == 0 {
		return nil, nil, fmt.Errorf("%w: storetest: empty batch", inbox.ErrInvalidConfig)
	}
	seen := map[inbox.Key]bool{}
	for _, c := range p.Claims {
		if seen[c.Key] || c.Key.ConsumerName != p.Claims[0].Key.ConsumerName {
			return nil, nil, fmt.Errorf("%w: storetest: a batch holds distinct keys of one consumer", inbox.ErrInvalidConfig)
		}
		seen[c.Key] = true
	}
	b := &MemBatchTx{s: s, writer: &MemTx{s: s, writes: map[string]int64{}}, counted: p.Counted}
	res := make([]inbox.CountedClaimResult, len(p.Claims))
	for k, c := range p.Claims {
		c.Isolation = p.Isolation
		tx, r, err := s.claim(ctx, c, p.Counted)
		if err != nil {
			_ = b.Rollback(context.Background())
			return nil, nil, err
		}
		res[k] = r
		b.members = append(b.members, tx)
		b.countedFirst = append(b.countedFirst, r.Counted)
		b.dropped = append(b.dropped, false)
	}
	return b, res, nil
}

// MemBatchTx is an open MemStore batch: the claims of its members and one set of writes.
type MemBatchTx struct {
	s            *MemStore
	writer       *MemTx   // the handlers' writes
	members      []*MemTx // nil: not claimed
	countedFirst []bool
	dropped      []bool
	counted      bool
	snapshot     map[string]int64 // the writes at the last Savepoint; nil: none open
	ended        bool
}

// Context implements inbox.Tx: every member's handler reaches the batch's MemTx.
func (b *MemBatchTx) Context(ctx context.Context) context.Context {
	return context.WithValue(ctx, memTxKey{}, b.writer)
}

// Savepoint implements inbox.BatchTx.
func (b *MemBatchTx) Savepoint(context.Context) error {
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	if b.ended {
		return errors.New("storetest: savepoint: the batch has ended")
	}
	b.snapshot = maps.Clone(b.writer.writes)
	return nil
}

// Aborted implements inbox.BatchTx: a MemStore transaction never fails a statement.
func (b *MemBatchTx) Aborted() bool { return false }

// Drop implements inbox.BatchTx: the writes since the savepoint are discarded, the member's
// claim released and p applied to its record at once; the key's count lock is held until the
// batch ends.
func (b *MemBatchTx) Drop(_ context.Context, member int, p inbox.FailParams) (int, error) {
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	if member < 0 || member >= len(b.members) || b.dropped[member] || b.members[member] == nil {
		return 0, fmt.Errorf("storetest: drop: no member %d in the batch", member)
	}
	b.dropped[member] = true
	if b.snapshot != nil {
		b.writer.writes = b.snapshot
		b.snapshot = nil
	}
	tx := b.members[member]
	if b.s.held[tx.key] == tx {
		delete(b.s.held, tx.key)
	}
	n := 0
	if b.counted {
		n = b.s.adjust(tx.key, p.AttemptsDelta, p.Error)
	}
	b.s.changed()
	return n, nil
}

// Commit implements inbox.Tx: every member's claim and the writes become visible at once.
func (b *MemBatchTx) Commit(context.Context) error {
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	if b.ended {
		return nil
	}
	b.ended = true
	for k, tx := range b.members {
		if tx == nil {
			continue
		}
		if !b.dropped[k] {
			b.s.rows[tx.key] = memRow{hash: tx.hash, receivedAt: b.s.now()}
			if tx.counted && !b.s.records[tx.key].DeadLettered {
				delete(b.s.records, tx.key)
			}
		}
		tx.release(false)
	}
	for name, d := range b.writer.writes {
		b.s.values[name] += d
	}
	b.s.changed()
	return nil
}

// Rollback implements inbox.Tx: the claims and writes are discarded and the counts of members
// still in the batch taken back.
func (b *MemBatchTx) Rollback(context.Context) error {
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	if b.ended {
		return nil
	}
	b.ended = true
	for k, tx := range b.members {
		if tx != nil {
			tx.release(b.countedFirst[k] && !b.dropped[k])
		}
	}
	b.s.changed()
	return nil
}
