package storetest

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
)

// ClaimBatch claims each key as Claim would, in the order given, without waiting: a key held
// by another transaction is decided RunAlone. The members' handlers write through one MemTx
// (MemTxFromContext) whose writes take effect at Commit.
func (s *MemStore) ClaimBatch(ctx context.Context, ds []contract.Delivery) (contract.BatchTx, []contract.Claim, error) {
	if len(ds) == 0 {
		return nil, nil, errors.New("storetest: empty batch")
	}
	if err := checkIsolation(ds[0].Isolation); err != nil {
		return nil, nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	seen := map[contract.Key]bool{}
	for _, d := range ds {
		if seen[d.Key] || d.Key.ConsumerName != ds[0].Key.ConsumerName {
			return nil, nil, errors.New("storetest: a batch holds distinct keys of one consumer")
		}
		seen[d.Key] = true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	b := &MemBatchTx{s: s, writer: &MemTx{s: s, writes: map[string]int64{}}, members: make([]*MemTx, len(ds))}
	claims := make([]contract.Claim, len(ds))
	for k, d := range ds {
		if s.held[d.Key] {
			claims[k] = contract.Claim{Decision: contract.RunAlone}
			continue
		}
		b.members[k], claims[k] = s.claimLocked(d)
	}
	return b, claims, nil
}

// MemBatchTx is an open MemStore batch: the claims of its members and one set of writes.
type MemBatchTx struct {
	s        *MemStore
	writer   *MemTx           // the handlers' writes
	members  []*MemTx         // nil: not in the batch
	snapshot map[string]int64 // the writes at the last Savepoint; nil: none open
	ended    bool
}

// Context returns ctx carrying the batch's MemTx.
func (b *MemBatchTx) Context(ctx context.Context) context.Context { return b.writer.Context(ctx) }

// Savepoint remembers the writes so far.
func (b *MemBatchTx) Savepoint(context.Context) error {
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	b.snapshot = maps.Clone(b.writer.writes)
	return nil
}

// Healthy is nil until the batch ends.
func (b *MemBatchTx) Healthy() error {
	if b.ended {
		return errors.New("storetest: the batch has ended")
	}
	return nil
}

// Drop takes member k out: its writes since the last Savepoint go, its claim is released and
// f recorded.
func (b *MemBatchTx) Drop(_ context.Context, k int, f contract.Failure) (int, error) {
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	if k < 0 || k >= len(b.members) || b.members[k] == nil {
		return 0, fmt.Errorf("storetest: no member %d in the batch", k)
	}
	m := b.members[k]
	b.members[k] = nil
	if b.snapshot != nil {
		b.writer.writes = maps.Clone(b.snapshot)
	}
	n := b.s.settle(m.key, m.counting, m.counted, f)
	m.release()
	return n, nil
}

// Commit commits every member still in the batch and the writes.
func (b *MemBatchTx) Commit(context.Context) error {
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	if b.ended {
		return nil
	}
	b.ended = true
	for name, d := range b.writer.writes {
		b.s.values[name] += d
	}
	for _, m := range b.members {
		if m == nil {
			continue
		}
		b.s.rows[m.key] = memRow{m.hash, time.Now()}
		if m.counting && !b.s.records[m.key].DeadLettered {
			delete(b.s.records, m.key)
		}
		m.release()
	}
	return nil
}

// Rollback releases every member still in the batch and takes back their counts.
func (b *MemBatchTx) Rollback(context.Context) error {
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	if b.ended {
		return nil
	}
	b.ended = true
	for _, m := range b.members {
		if m != nil {
			b.s.settle(m.key, m.counting, m.counted, contract.Failure{})
			m.release()
		}
	}
	return nil
}
