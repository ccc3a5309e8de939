package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
)

// The group commit of counts, as in pgstore (its count.go says why): a delivery that counts
// first is counted durably after its claim and before its handler, by the claim's holder, in
// a transaction of its own; the counts of every delivery that asks while one count
// transaction runs are written by the next one (queries/<dialect>/count.sql per key, then
// record.sql to read the count back, one COMMIT). On PostgreSQL the count transaction
// commits asynchronously (async_commit.sql); on MySQL it commits as the server's
// innodb_flush_log_at_trx_commit says. The count transactions run one at a time on
// connections of the *sql.DB (pgstore counts on a connection outside its pool; a *sql.DB
// offers no way to open one): while every connection is held by deliveries waiting for their
// counts, a count waits up to the finish timeout and the claims fail, so the pool needs the
// subscriber's concurrency plus 2 (TestMySQLKeyLockReleasedOnEveryPath runs on 2).

type counter struct {
	s       *Store
	mu      sync.Mutex
	queue   []*countRequest
	running bool
}

type countRequest struct {
	keys     []keyT
	attempts []int // per key, the count afterwards; -1 when not counted (dead-lettered)
	err      error
	done     chan struct{}
}

// count counts one attempt for each of keys (distinct, each claimed by the caller) and returns
// their counts afterwards, -1 for a key that was not counted (dead-lettered). It waits for the
// transaction that carries them even when ctx ends: the outcome must be known. finish bounds
// that transaction.
func (c *counter) count(_ context.Context, keys []keyT, finish time.Duration) ([]int, error) {
	r := &countRequest{keys: keys, done: make(chan struct{})}
	c.mu.Lock()
	c.queue = append(c.queue, r)
	start := !c.running
	c.running = true
	c.mu.Unlock()
	if start {
		go c.run(finish)
	}
	<-r.done
	return r.attempts, r.err
}

// run writes the queued counts, one transaction per round, until none is queued.
func (c *counter) run(finish time.Duration) {
	for {
		c.mu.Lock()
		q := c.queue
		c.queue = nil
		if len(q) == 0 {
			c.running = false
			c.mu.Unlock()
			return
		}
		c.mu.Unlock()
		later := c.flush(q, finish)
		if len(later) > 0 {
			c.mu.Lock()
			c.queue = append(later, c.queue...)
			c.mu.Unlock()
		}
	}
}

// flush writes the counts of q in one transaction and answers each request. A request with a
// key already in this round waits for the next.
func (c *counter) flush(q []*countRequest, finish time.Duration) (later []*countRequest) {
	seen := map[keyT]bool{}
	var now []*countRequest
	var keys []keyT
	for _, r := range q {
		clash := false
		for _, k := range r.keys {
			clash = clash || seen[k]
		}
		if clash {
			later = append(later, r)
			continue
		}
		for _, k := range r.keys {
			seen[k] = true
			keys = append(keys, k)
		}
		now = append(now, r)
	}
	ctx, cancel := context.WithTimeout(context.Background(), finish)
	defer cancel()
	counts, err := c.exec(ctx, keys)
	for _, r := range now {
		r.err = err
		if err == nil {
			r.attempts = make([]int, len(r.keys))
			for k, key := range r.keys {
				r.attempts[k] = counts[key]
			}
		}
		close(r.done)
	}
	return later
}

// exec counts keys in one transaction and returns their counts (-1: dead-lettered).
func (c *counter) exec(ctx context.Context, keys []keyT) (map[keyT]int, error) {
	s := c.s
	var counts map[keyT]int
	err := s.inTx(ctx, s.db, func(tx *sql.Tx) error {
		counts = make(map[keyT]int, len(keys))
		if s.q.asyncCommit.sql != "" {
			if _, err := tx.ExecContext(ctx, s.q.asyncCommit.sql); err != nil {
				return err
			}
		}
		for _, k := range keys {
			if _, err := s.q.count.exec(ctx, tx, keyArgs(k)); err != nil {
				return err
			}
			var rec contract.Record
			if err := s.readRecord(ctx, tx, k, &rec); err != nil {
				return err
			}
			counts[k] = rec.Attempts
			if rec.DeadLettered {
				counts[k] = -1
			}
		}
		return nil
	})
	if err != nil {
		if st := s.db.Stats(); st.MaxOpenConnections > 0 && st.InUse >= st.MaxOpenConnections {
			err = fmt.Errorf("%w (all %d connections in use: size the pool to the concurrency plus 2)", err, st.MaxOpenConnections)
		}
		return nil, errors.Join(errCountUnknown, err)
	}
	return counts, nil
}

// errCountUnknown: a count transaction failed; it may have committed or not.
var errCountUnknown = errors.New("sqlstore: the count transaction failed")
