package deferred

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/semaphore"

	"github.com/watermill-inbox/watermill-inbox/internal/keyrule"
	"github.com/watermill-inbox/watermill-inbox/internal/pgtx"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// maxErrorBytes bounds last_error, in bytes.
const maxErrorBytes = 1024

// ErrWorkersRunning is returned by a second call of Workers.Run.
var ErrWorkersRunning = errors.New("deferred: Workers.Run called twice")

// Workers handle the stored rows of one Inbox with one handler: Config.Workers goroutines
// that claim batches into one queue and take their rows from it, a reaper, and a listener on
// the inbox's NOTIFY channel. A claim reads no payload; a worker loads a row's payload and
// metadata when it starts the row, within the byte budget Config.MaxInFlightBytes. Run them in
// as many processes as needed: claims never overlap (FOR UPDATE SKIP LOCKED) and the reaper is
// safe on every instance.
type Workers struct {
	ib     *Inbox
	h      message.HandlerFunc
	wake   []chan struct{}
	budget *semaphore.Weighted // bytes of payload and metadata loaded

	qmu    sync.Mutex
	queue  []claimedRow // claimed, not started: every worker takes from it
	cursor string       // the aggregate key the last claim reached: the next one starts after it

	stop        context.Context // ends claiming
	stopCancel  context.CancelFunc
	hctx        context.Context // the handlers' context; cancelled ShutdownTimeout after stop
	hcancel     context.CancelFunc
	started     chan struct{}
	finished    chan struct{}
	startOnce   sync.Once
	running     bool
	runningLock sync.Mutex
}

// NewWorkers returns the workers that run h on the inbox's rows. h is the same handler the
// immediate inbox runs: its message carries the row's UUID, payload and metadata, and its
// context the row's transaction (pgstore.TxFromContext). Messages h returns are written
// through Config.Outbox in that transaction, for Config.PublishTopic.
func (i *Inbox) NewWorkers(h message.HandlerFunc) *Workers {
	w := &Workers{ib: i, h: h, started: make(chan struct{}), finished: make(chan struct{}),
		budget: semaphore.NewWeighted(i.cfg.MaxInFlightBytes)}
	w.stop, w.stopCancel = context.WithCancel(context.Background())
	w.hctx, w.hcancel = context.WithCancel(context.Background())
	for range i.cfg.Workers {
		w.wake = append(w.wake, make(chan struct{}, 1))
	}
	return w
}

// NewConsumerWorkers is NewWorkers for a handler that returns no messages.
func (i *Inbox) NewConsumerWorkers(h message.NoPublishHandlerFunc) *Workers {
	return i.NewWorkers(func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) })
}

// Running is closed once Run has started its goroutines.
func (w *Workers) Running() <-chan struct{} { return w.started }

// Run runs the workers until ctx ends or Close is called, then shuts down gracefully: no new
// claims; rows being handled get Config.ShutdownTimeout to finish (then their context is
// cancelled, and a row whose handler returns because of it is released without using up an
// attempt); claimed rows not started are released to pending. It returns nil after a
// graceful shutdown, or ErrWorkersRunning when called twice.
func (w *Workers) Run(ctx context.Context) error {
	w.runningLock.Lock()
	if w.running {
		w.runningLock.Unlock()
		return ErrWorkersRunning
	}
	w.running = true
	w.runningLock.Unlock()
	defer close(w.finished)
	stopAfter := context.AfterFunc(ctx, w.stopCancel)
	defer stopAfter()

	var wg sync.WaitGroup
	var aux sync.WaitGroup
	aux.Add(2)
	go func() { defer aux.Done(); w.listen() }()
	go func() { defer aux.Done(); w.reap() }()
	for n := range w.wake {
		wg.Add(1)
		go func() { defer wg.Done(); w.work(n) }()
	}
	w.startOnce.Do(func() { close(w.started) })
	<-w.stop.Done()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(w.ib.cfg.ShutdownTimeout):
		w.ib.logger.Info("Shutdown timeout: cancelling the handlers still running", nil)
		w.hcancel()
		<-done
	}
	w.hcancel()
	aux.Wait()
	w.qmu.Lock()
	w.release(w.queue) // claimed, never started
	w.queue = nil
	w.qmu.Unlock()
	return nil
}

// Close stops the workers (as when Run's context ends) and waits for Run to return. It is
// safe to call more than once, and before Run (Run then returns at once).
func (w *Workers) Close() error {
	w.stopCancel()
	w.runningLock.Lock()
	running := w.running
	w.runningLock.Unlock()
	if running {
		<-w.finished
	}
	return nil
}

// broadcast wakes every idle worker.
func (w *Workers) broadcast() {
	for _, c := range w.wake {
		select {
		case c <- struct{}{}:
		default:
		}
	}
}

// claimedRow is a row as claimed (without payload and metadata), then as started (with them).
type claimedRow struct {
	id         int64
	token      uuid.UUID // the claim's fencing token
	key, uuid  string
	aggregate  *string
	topic      string
	size       int64 // bytes of payload and metadata (JSON text), as the claim measured them
	payload    []byte
	metadata   []byte
	receivedAt time.Time
}

// work is one worker's loop: take a row from the queue (claiming a batch when it is empty),
// reserve its bytes from the budget, handle it.
func (w *Workers) work(n int) {
	cfg := w.ib.cfg
	name := cfg.WorkerName + "/" + strconv.Itoa(n)
	for w.stop.Err() == nil {
		r, ok := w.next(name)
		if !ok {
			select {
			case <-w.stop.Done():
				return
			case <-w.wake[n]:
			case <-time.After(cfg.PollInterval):
			}
			continue
		}
		// A row larger than the whole budget is loaded alone.
		weight := min(r.size, cfg.MaxInFlightBytes)
		if w.stop.Err() != nil || w.budget.Acquire(w.stop, weight) != nil {
			w.release([]claimedRow{r})
			return
		}
		w.process(r, name)
		w.budget.Release(weight)
	}
}

// next takes the queue's first row. When the queue is empty it claims a batch into it first
// (one claim at a time per Workers); when rows remain after the take, it wakes the idle workers
// so that they take them.
func (w *Workers) next(name string) (claimedRow, bool) {
	w.qmu.Lock()
	defer w.qmu.Unlock()
	if len(w.queue) == 0 && w.stop.Err() == nil {
		w.fill(name)
	}
	if len(w.queue) == 0 {
		return claimedRow{}, false
	}
	r := w.queue[0]
	w.queue = w.queue[1:]
	if len(w.queue) > 0 {
		w.broadcast()
	}
	return r, true
}

// fill claims a batch into the empty queue. Each claim starts its scan over the aggregates
// after the last aggregate key the previous one reached (when that one was full), and wraps
// around at once when nothing is found past it, so every aggregate gets its turn under load.
func (w *Workers) fill(name string) {
	for {
		wrapped := w.cursor == ""
		rows, err := w.claim(name, w.cursor)
		if err != nil {
			w.ib.logger.Error("Claim failed", err, nil)
			w.cursor = ""
			return
		}
		next, ordered := "", 0
		for _, r := range rows {
			if r.aggregate != nil {
				ordered++
				next = max(next, *r.aggregate)
			}
		}
		w.cursor = ""
		if ordered >= w.ib.cfg.BatchSize {
			w.cursor = next // more aggregates may follow
		}
		if len(rows) > 0 || wrapped {
			w.queue = rows
			return
		}
	}
}

// claim claims a batch in one statement (its own short transaction), on a context detached
// from shutdown, so a claim that committed is never lost to a cancelled read.
func (w *Workers) claim(name, cursor string) ([]claimedRow, error) {
	cfg := w.ib.cfg
	token := uuid.New()
	ctx, cancel := context.WithTimeout(context.Background(), cfg.FinishTimeout)
	defer cancel()
	rows, err := cfg.Pool.Query(ctx, w.ib.n.claimSQL, cfg.ConsumerName, cfg.BatchSize, name, token, cursor)
	if err != nil {
		return nil, fmt.Errorf("deferred: claim: %w", err)
	}
	var out []claimedRow
	for rows.Next() {
		r := claimedRow{token: token}
		if err := rows.Scan(&r.id, &r.key, &r.uuid, &r.aggregate, &r.topic, &r.size, &r.receivedAt); err != nil {
			rows.Close()
			w.release(out)
			return nil, fmt.Errorf("deferred: claim: %w", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		w.release(out)
		return nil, fmt.Errorf("deferred: claim: %w", err)
	}
	slices.SortFunc(out, func(a, b claimedRow) int { return cmp.Compare(a.id, b.id) }) // RETURNING has no order
	return out, nil
}

// release returns claimed rows not started to pending (each fenced by its claim's token).
func (w *Workers) release(rows []claimedRow) {
	if len(rows) == 0 {
		return
	}
	ids, tokens := make([]int64, len(rows)), make([]uuid.UUID, len(rows))
	for k, r := range rows {
		ids[k], tokens[k] = r.id, r.token
	}
	ctx, cancel := context.WithTimeout(context.Background(), w.ib.cfg.FinishTimeout)
	defer cancel()
	if _, err := w.ib.cfg.Pool.Exec(ctx, w.ib.n.releaseSQL, ids, tokens); err != nil {
		w.ib.logger.Error("Could not release claimed rows; the reaper will", err, watermill.LogFields{"rows": len(ids)})
	}
}

// process handles one claimed row: it counts the attempt durably, locks the row (fenced by
// the token) and loads its payload and metadata in one round trip, runs the handler in the
// row's transaction, marks the row done and commits; or records the failure.
func (w *Workers) process(r claimedRow, name string) {
	ib, cfg := w.ib, w.ib.cfg
	dctx, dcancel := context.WithTimeout(context.Background(), cfg.FinishTimeout)
	defer dcancel()
	log := watermill.LogFields{"message_uuid": keyrule.SafeID(r.uuid), "row": r.id}
	conn, err := cfg.Pool.Acquire(dctx)
	if err != nil {
		ib.logger.Error("Could not acquire a connection; releasing the row", err, log)
		w.release([]claimedRow{r})
		return
	}
	defer conn.Release()
	tx, attempts, ok := w.start(dctx, conn, &r, name, log)
	if !ok {
		return
	}
	if earlier := int(attempts) - 1; earlier >= cfg.MaxAttempts {
		_ = tx.Rollback(dctx)
		reason := fmt.Sprintf("%d of %d attempts ran the handler and ended without settling, recording no error: the worker died or lost its database connection while the handler ran", earlier, cfg.MaxAttempts)
		w.fail(r, earlier, -1, true, reason, log)
		return
	}
	msg := r.message()
	txCtx := pgtx.With(w.hctx, tx)
	msg.SetContext(txCtx)
	herr := w.run(msg, txCtx, tx)
	if herr == nil {
		w.commit(dctx, conn, r, log)
		return
	}
	_ = tx.Rollback(dctx)
	if errors.Is(w.hctx.Err(), context.Canceled) && !inbox.IsPermanent(herr) {
		// Abandoned by shutdown: not the message's failure.
		w.fail(r, int(attempts)-1, -1, false, "", log)
		return
	}
	ib.failed.Add(1)
	dead := inbox.IsPermanent(herr) || int(attempts) >= cfg.MaxAttempts
	reason := herr.Error()
	if dead {
		if inbox.IsPermanent(herr) {
			reason = "permanent error: " + reason
		} else {
			reason = fmt.Sprintf("failed %d of %d attempts; last error: %s", attempts, cfg.MaxAttempts, reason)
		}
	}
	w.fail(r, int(attempts), 0, dead, reason, log)
}

// start sends, in one round trip, a transaction of its own that counts the attempt (and names
// this worker in claimed_by), then the row's transaction: BEGIN, the idle timeout, and the
// row's lock, which loads its payload and metadata into r. ok is false when the row could not
// be started (released) or was fenced (its token no longer matches: skipped).
func (w *Workers) start(ctx context.Context, conn *pgxpool.Conn, r *claimedRow, name string, log watermill.LogFields) (tx pgx.Tx, attempts int32, ok bool) {
	ib := w.ib
	var counted, locked bool
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue("set local synchronous_commit to off")
	b.Queue(ib.n.countSQL, r.id, r.token, name).QueryRow(func(row pgx.Row) error {
		err := row.Scan(&attempts)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		counted = err == nil
		return err
	})
	b.Queue("commit")
	b.Queue("begin isolation level read committed")
	b.Queue("select set_config('idle_in_transaction_session_timeout', $1, true)", strconv.FormatInt(ib.cfg.Lease.Milliseconds(), 10))
	b.Queue(ib.n.lockSQL, r.id, r.token).QueryRow(func(row pgx.Row) error {
		err := row.Scan(&r.payload, &r.metadata)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		locked = err == nil
		return err
	})
	br := conn.Conn().SendBatch(ctx, b)
	tx = br.Tx()
	if err := br.Close(); err != nil {
		_, _ = conn.Exec(ctx, "rollback")
		ib.logger.Error("Could not start the row; releasing it", err, log)
		w.release([]claimedRow{*r})
		return nil, 0, false
	}
	if !counted || !locked {
		_ = tx.Rollback(ctx)
		ib.fenced.Add(1)
		ib.logger.Info("Row fenced: its claim was released by the reaper; skipped", log)
		return nil, 0, false
	}
	return tx, attempts, true
}

// message is the handler's message: the row's UUID, payload and metadata.
func (r claimedRow) message() *message.Message {
	msg := message.NewMessage(r.uuid, r.payload)
	if len(r.metadata) > 0 {
		md := map[string]string{}
		if err := json.Unmarshal(r.metadata, &md); err == nil {
			for k, v := range md {
				msg.Metadata.Set(k, v)
			}
		}
	}
	return msg
}

// commit sends the done-mark and COMMIT in one round trip. A mark that matches no row (the
// token changed) fails with division_by_zero (SQLSTATE 22012), which aborts the transaction,
// so the handler's writes can never commit without the row's done-mark.
func (w *Workers) commit(ctx context.Context, conn *pgxpool.Conn, r claimedRow, log watermill.LogFields) {
	ib := w.ib
	var markErr error
	var tag pgconn.CommandTag
	cb := &pgx.Batch{}
	cb.Queue(ib.n.doneSQL, r.id, r.token).QueryRow(func(row pgx.Row) error {
		var one int32
		markErr = row.Scan(&one)
		return nil
	})
	cb.Queue("commit").Exec(func(ct pgconn.CommandTag) error { tag = ct; return nil })
	err := conn.Conn().SendBatch(ctx, cb).Close()
	if err == nil && markErr == nil && tag.String() != "COMMIT" {
		err = pgx.ErrTxCommitRollback
	}
	if err == nil && markErr == nil {
		ib.done.Add(1)
		return
	}
	_, _ = conn.Exec(ctx, "rollback")
	ib.fenced.Add(1)
	var pgErr *pgconn.PgError
	if errors.As(markErr, &pgErr) && pgErr.Code == "22012" || errors.As(err, &pgErr) && pgErr.Code == "22012" {
		ib.logger.Info("Row fenced at its done-mark: its claim was released; rolled back", log)
		return
	}
	// Rolled back, or unknown: a row that did not commit stays processing under this token
	// until the reaper returns it to pending, its attempt counted.
	ib.logger.Error("Could not mark the row done and commit; rolled back unless it committed", errors.Join(markErr, err), log)
}

// run calls the handler, turning a panic into an error, and writes its output to the outbox.
func (w *Workers) run(msg *message.Message, txCtx context.Context, tx pgx.Tx) (err error) {
	defer func() {
		if p := recover(); p != nil {
			buf := make([]byte, 2048)
			buf = buf[:runtime.Stack(buf, false)]
			w.ib.logger.Error("Handler panicked", fmt.Errorf("%v", p), watermill.LogFields{"message_uuid": keyrule.SafeID(msg.UUID), "stack": string(buf)})
			err = fmt.Errorf("deferred: handler panicked: %v", p)
		}
	}()
	produced, err := w.h(msg)
	if err != nil || len(produced) == 0 {
		return err
	}
	if w.ib.cfg.Outbox == nil {
		return inbox.ErrProducedMessages
	}
	if err := w.ib.cfg.Outbox.Store(txCtx, w.ib.cfg.PublishTopic, produced); err != nil {
		return fmt.Errorf("deferred: storing %d produced messages in the outbox: %w", len(produced), err)
	}
	return nil
}

// fail records a run that did not settle the row: back to pending after a backoff, or dead
// (published to the dead-letter topic first, when one is configured). delta adjusts the
// attempt count (-1 takes back a count that ran no handler).
func (w *Workers) fail(r claimedRow, attempts, delta int, dead bool, reason string, log watermill.LogFields) {
	ib, cfg := w.ib, w.ib.cfg
	ctx, cancel := context.WithTimeout(context.Background(), cfg.FinishTimeout)
	defer cancel()
	var delay time.Duration
	if !dead && reason != "" {
		delay = backoff(cfg.Backoff, cfg.MaxBackoff, attempts)
	}
	if dead && cfg.DeadLetterPublisher != nil {
		if err := ib.publishDeadLetter(ctx, r.message(), r.key, reason, attempts, r.topic); err != nil {
			// Never dead without its dead letter: retry later.
			ib.logger.Error("Could not publish the dead letter; the row stays pending", err, log)
			dead, delay = false, backoff(cfg.Backoff, cfg.MaxBackoff, attempts)
		}
	}
	var lastErr *string
	if reason != "" {
		s := truncateUTF8(reason, maxErrorBytes)
		lastErr = &s
	}
	ct, err := cfg.Pool.Exec(ctx, ib.n.failSQL, r.id, r.token, dead, delay.Seconds(), lastErr, delta)
	switch {
	case err != nil:
		ib.logger.Error("Could not record the failure; the reaper returns the row", err, log)
	case ct.RowsAffected() == 0:
		ib.fenced.Add(1)
	case dead:
		ib.dead.Add(1)
		ib.logger.Error("Row dead", errors.New(truncateUTF8(reason, maxErrorBytes)), log)
	case reason != "":
		ib.logger.Info("Handler failed; row back to pending", log.Add(watermill.LogFields{"attempts": attempts, "retry_in": delay.String(), "error": truncateUTF8(reason, 200)}))
	}
}

// backoff is base*2^(attempts-1), capped, with jitter: between half and all of it.
func backoff(base, limit time.Duration, attempts int) time.Duration {
	d := base
	for k := 1; k < attempts && d < limit; k++ {
		d *= 2
	}
	d = min(d, limit)
	if d <= 0 {
		return 0
	}
	return d/2 + rand.N(d/2+1)
}

// reap returns rows stuck in processing past the lease to pending, every ReapInterval.
func (w *Workers) reap() {
	cfg := w.ib.cfg
	t := time.NewTicker(cfg.ReapInterval)
	defer t.Stop()
	for {
		select {
		case <-w.stop.Done():
			return
		case <-t.C:
		}
		n, err := w.ib.Reap(w.stop)
		if err != nil && w.stop.Err() == nil {
			w.ib.logger.Error("Reaper failed", err, nil)
		}
		if n > 0 {
			w.broadcast()
		}
	}
}

// Reap returns this consumer's rows that have been in processing longer than Config.Lease and
// whose row transaction is not open (FOR UPDATE SKIP LOCKED passes over rows a live worker
// holds) to pending, up to 1,000 per call, and returns how many. Their tokens are cleared, so
// their old worker can neither start nor finish them. Workers run it every ReapInterval; it is
// safe to run from every instance at once.
func (i *Inbox) Reap(ctx context.Context) (int64, error) {
	ct, err := i.cfg.Pool.Exec(ctx, i.n.reapSQL, i.cfg.ConsumerName, i.cfg.Lease.Seconds())
	if err != nil {
		return 0, fmt.Errorf("deferred: reap: %w", err)
	}
	n := ct.RowsAffected()
	if n > 0 {
		i.reaped.Add(uint64(n))
		i.logger.Info("Reaper returned stale claims to pending", watermill.LogFields{"rows": n})
	}
	return n, nil
}

// listen holds a dedicated connection (not from the pool) that LISTENs on the inbox's channel
// and wakes the workers on each notification for this consumer. It reconnects after an
// error; the poll interval covers notifications lost meanwhile.
func (w *Workers) listen() {
	cfg := w.ib.cfg
	for w.stop.Err() == nil {
		conn, err := pgx.ConnectConfig(w.stop, cfg.Pool.Config().ConnConfig.Copy())
		if err == nil {
			_, err = conn.Exec(w.stop, "LISTEN "+pgx.Identifier{w.ib.n.channel}.Sanitize())
		}
		if err == nil {
			w.broadcast() // whatever arrived while not listening
			for {
				var n *pgconn.Notification
				n, err = conn.WaitForNotification(w.stop)
				if err != nil {
					break
				}
				if n.Payload == cfg.ConsumerName {
					w.broadcast()
				}
			}
		}
		if conn != nil {
			cctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = conn.Close(cctx)
			cancel()
		}
		if w.stop.Err() != nil {
			return
		}
		w.ib.logger.Error("LISTEN connection lost; polling until it is back", err, nil)
		select {
		case <-w.stop.Done():
		case <-time.After(cfg.PollInterval):
		}
	}
}

// truncateUTF8 cuts s to at most n bytes on a rune boundary.
func truncateUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

func utf8RuneStart(b byte) bool { return b&0xC0 != 0x80 }
