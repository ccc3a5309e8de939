package pgstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// The store's count connection. Two kinds of writes must commit while a transaction still
// holds a key, so that a copy waiting for the key reads them, and cannot wait for a pool
// connection (the pool may be exhausted by the very deliveries that wait):
//
//   - the counts of a batch's members that count first (their broker does not mark them as
//     first deliveries), after the batch's claims and before its handlers run, in one statement
//     for the whole batch and for every batch asking while one count statement runs
//     (queries/count.sql), as PostgreSQL groups WAL flushes;
//   - the record of a failure (Fail, Drop) or a take-back, while the claim transaction is open
//     and holds the key's lock.
//
// A single claim that counts first counts in its own round trip instead (claim.go,
// queries/count_first.sql). The statements run one at a time on a connection of their own,
// outside the pool, with synchronous_commit off: a count survives any crash of the consumer and
// any rollback; only a crash of the PostgreSQL server within wal_writer_delay (200 ms by
// default) can lose it, which costs a poison message one extra attempt. The connection is
// closed after counterIdle without a count.

// counterIdle is how long the count connection stays open without a count.
const counterIdle = 2 * time.Second

type counter struct {
	s       *Store
	closed  bool // Store.Close: no more counts
	mu      sync.Mutex
	queue   []*countRequest
	running bool
	conn    *pgx.Conn   // the count connection; nil when closed
	idle    *time.Timer // closes conn after counterIdle
}

type countRequest struct {
	keys     []inbox.Key
	settle   *settleJob // instead of keys: one record to write (Fail, Drop, a take-back)
	attempts []int      // per key (or for the settle), the count afterwards; -1 when not counted
	err      error
	done     chan struct{}
}

// settleJob is a change to one key's attempt record: delta and the last error (record).
type settleJob struct {
	key     inbox.Key
	period  time.Time
	delta   int
	errText string
}

// count counts one attempt for each of keys (distinct, each claimed by the caller) and returns
// their counts afterwards, -1 for a key that was not counted (dead-lettered). It waits for the
// statement that carries them even when ctx ends: the outcome must be known. finish bounds
// that statement.
func (c *counter) count(_ context.Context, keys []inbox.Key, finish time.Duration) ([]int, error) {
	r := &countRequest{keys: keys, done: make(chan struct{})}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, errStoreClosed
	}
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

// record applies delta and errText to k's attempt record (Store.record) on the count
// connection, in the next round, and returns the count afterwards. Fail, Drop and the
// take-backs use it while their claim still holds the key, so they never wait for a pool
// connection (the pool may be exhausted by the very deliveries that fail).
func (c *counter) record(k inbox.Key, period time.Time, delta int, errText string, finish time.Duration) (int, error) {
	r := &countRequest{settle: &settleJob{k, period, delta, errText}, done: make(chan struct{})}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return 0, errStoreClosed
	}
	c.queue = append(c.queue, r)
	start := !c.running
	c.running = true
	c.mu.Unlock()
	if start {
		go c.run(finish)
	}
	<-r.done
	if r.err != nil {
		return 0, r.err
	}
	return r.attempts[0], nil
}

// run writes the queued counts, one statement per round, until none is queued.
func (c *counter) run(finish time.Duration) {
	for {
		c.mu.Lock()
		q := c.queue
		c.queue = nil
		if len(q) == 0 {
			c.running = false
			c.idleLocked()
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

// idleLocked (re)arms the timer that closes the connection once no count came for
// counterIdle. c.mu must be held.
func (c *counter) idleLocked() {
	if c.conn == nil {
		return
	}
	if c.idle != nil {
		c.idle.Stop()
	}
	conn := c.conn
	c.idle = time.AfterFunc(counterIdle, func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.running || c.conn != conn {
			return
		}
		c.conn = nil
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(ctx)
	})
}

type countKey struct{ id, consumer string }

// flush writes the counts of q in one statement and answers each request. A request with a
// key already in this statement waits for the next (a statement cannot update a row twice).
func (c *counter) flush(q []*countRequest, finish time.Duration) (later []*countRequest) {
	var ids, consumers []string
	seen := map[countKey]bool{}
	var now, settles []*countRequest
	for _, r := range q {
		if r.settle != nil {
			settles = append(settles, r)
			continue
		}
		clash := false
		for _, k := range r.keys {
			clash = clash || seen[countKey{k.MessageID, k.ConsumerName}]
		}
		if clash {
			later = append(later, r)
			continue
		}
		for _, k := range r.keys {
			seen[countKey{k.MessageID, k.ConsumerName}] = true
			ids, consumers = append(ids, k.MessageID), append(consumers, k.ConsumerName)
		}
		now = append(now, r)
	}
	ctx, cancel := context.WithTimeout(context.Background(), finish)
	defer cancel()
	counts, err := c.exec(ctx, ids, consumers, settles)
	for _, r := range settles {
		r.err = err
		close(r.done)
	}
	for _, r := range now {
		r.err = err
		if err == nil {
			r.attempts = make([]int, len(r.keys))
			for k, key := range r.keys {
				n, ok := counts[countKey{key.MessageID, key.ConsumerName}]
				if !ok {
					n = -1
				}
				r.attempts[k] = n
			}
		}
		close(r.done)
	}
	return later
}

// exec runs queries/count.sql for ids and the statements of settles, in one round trip on the
// count connection, opening it when needed; a connection that failed is closed, so the next
// round opens another. Each settle's count goes to its attempts.
func (c *counter) exec(ctx context.Context, ids, consumers []string, settles []*countRequest) (map[countKey]int, error) {
	c.mu.Lock()
	conn := c.conn
	if c.idle != nil {
		c.idle.Stop()
	}
	c.mu.Unlock()
	if conn == nil {
		var err error
		if conn, err = c.connect(ctx); err != nil {
			return nil, fmt.Errorf("%w: %w", errCountConnect, err)
		}
		c.mu.Lock()
		c.conn = conn
		c.mu.Unlock()
	}
	counts := make(map[countKey]int, len(ids))
	b := &pgx.Batch{}
	if len(ids) > 0 {
		q := c.s.q.count
		b.Queue(q.sql, q.args(&queryArgs{messageIDs: ids, consumerNames: consumers})...).Query(func(rows pgx.Rows) error {
			return scanRows(rows, func(rows pgx.Rows) error {
				var k countKey
				var n int32
				if err := rows.Scan(&k.id, &k.consumer, &n); err != nil {
					return err
				}
				counts[k] = int(n)
				return nil
			})
		})
	}
	for _, r := range settles {
		j := r.settle
		stmt, a := c.s.recordStatement(j.key, j.period, j.delta, j.errText)
		b.Queue(stmt.sql, stmt.args(a)...).QueryRow(func(row pgx.Row) error {
			var n int32
			err := row.Scan(&n)
			if errors.Is(err, pgx.ErrNoRows) {
				n, err = 0, nil
			}
			r.attempts = []int{int(n)}
			return err
		})
	}
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		pid := conn.PgConn().PID()
		c.mu.Lock()
		if c.conn == conn {
			c.conn = nil
		}
		c.mu.Unlock()
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = conn.Close(cctx)
		cancel()
		return nil, &countUnknownError{pid: pid, err: err}
	}
	return counts, nil
}

// countUnknownError: a count statement failed or its answer was lost; it may have committed.
// pid is the server process of the count connection it was sent on.
type countUnknownError struct {
	pid uint32
	err error
}

func (e *countUnknownError) Error() string {
	return "pgstore: the count statement failed: " + e.err.Error()
}
func (e *countUnknownError) Unwrap() error { return e.err }

// undoUnknown is the answer to a count of unknown outcome (err), made for keys the caller
// still holds, whose records held before[k] attempts at the claim: it ends the count
// connection's server process (so the statement can no longer commit), reads the records
// again, and takes back every count that did commit. No copy can count a held key meanwhile,
// so a record above before[k] is this count. It returns err, or the error of the undo.
func (c *counter) undoUnknown(ctx context.Context, err error, keys []inbox.Key, periods []time.Time, before []int, finish time.Duration) error {
	var unknown *countUnknownError
	if !errors.As(err, &unknown) {
		return err // nothing was sent (errCountConnect, a closed store)
	}
	s := c.s
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finish)
	defer cancel()
	if _, terr := s.pool.Exec(ctx, "SELECT pg_terminate_backend($1, $2)", int32(unknown.pid), finish.Milliseconds()); terr != nil {
		return errors.Join(err, fmt.Errorf("pgstore: end the count connection: %w", terr))
	}
	for k, key := range keys {
		var rec contract.Record
		q := s.q.record
		if rerr := scanRecord(s.pool.QueryRow(ctx, q.sql, q.args(keyArgs(key, periods[k]))...), &rec); rerr != nil {
			return errors.Join(err, fmt.Errorf("pgstore: read the record after a lost count: %w", rerr))
		}
		if rec.Attempts > before[k] {
			if _, rerr := c.record(key, periods[k], -1, "", finish); rerr != nil {
				return errors.Join(err, fmt.Errorf("pgstore: take back a lost count: %w", rerr))
			}
		}
	}
	return err
}

// connect opens a count connection as the pool opens its own: its configuration and its
// BeforeConnect and AfterConnect hooks (credentials a hook supplies, session settings), with
// synchronous_commit off.
func (c *counter) connect(ctx context.Context) (*pgx.Conn, error) {
	pcfg := c.s.pool.Config()
	cfg := pcfg.ConnConfig.Copy()
	cfg.RuntimeParams["synchronous_commit"] = "off"
	if pcfg.BeforeConnect != nil {
		if err := pcfg.BeforeConnect(ctx, cfg); err != nil {
			return nil, err
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if pcfg.AfterConnect != nil {
		if err := pcfg.AfterConnect(ctx, conn); err != nil {
			_ = conn.Close(ctx)
			return nil, err
		}
	}
	return conn, nil
}

// close closes the count connection and refuses later counts (Store.Close).
func (c *counter) close() {
	c.mu.Lock()
	c.closed = true
	conn := c.conn
	c.conn = nil
	if c.idle != nil {
		c.idle.Stop()
	}
	running := c.running
	c.mu.Unlock()
	if conn != nil && !running {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = conn.Close(ctx)
		cancel()
	}
}

// scanRows calls f with each row of rows.
func scanRows(rows pgx.Rows, f func(pgx.Rows) error) error {
	defer rows.Close()
	for rows.Next() {
		if err := f(rows); err != nil {
			return err
		}
	}
	return rows.Err()
}

// errStoreClosed: a count or a record asked of a closed Store.
var errStoreClosed = errors.New("pgstore: the store is closed")

// errCountConnect: the count connection could not be opened; nothing was sent.
var errCountConnect = errors.New("pgstore: open the count connection")
