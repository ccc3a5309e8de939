package inbox

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
)

// Group commit (the batched mode): deliveries that reach the inbox at the same time share one
// transaction and one COMMIT. See Config.Batch and docs/design.md, "Batched mode".

// BatchMode chooses how a batch survives a failing handler.
type BatchMode int

const (
	// BatchOptimistic (the default) takes no savepoints. When a member's handler fails, the
	// member's failure is recorded, the whole batch rolls back, and the other members run
	// again one transaction each, exactly as the immediate mode runs them. It is the faster
	// design while failures are rare (see docs/benchmarks.md, "Batched mode").
	BatchOptimistic BatchMode = iota
	// BatchSavepoints opens a savepoint before each member's handler. A failing handler rolls
	// back to it (its writes and its claim) and only that member is nacked or counted; the
	// others commit. Each member costs one more round trip.
	BatchSavepoints
)

// String returns "optimistic" or "savepoints".
func (m BatchMode) String() string {
	if m == BatchSavepoints {
		return "savepoints"
	}
	return "optimistic"
}

// Defaults and limits of BatchConfig.
const (
	// DefaultBatchLinger is how long the first delivery of a batch waits for others.
	DefaultBatchLinger = 2 * time.Millisecond
	// MaxBatchSize bounds BatchConfig.Size: the keys of a batch travel as arrays in one
	// statement, and every member's lock is held until the batch ends.
	MaxBatchSize = 1000
)

// BatchConfig turns on group commit (Config.Batch). The zero value is off: one transaction per
// delivery (the immediate mode).
//
// A batch gathers deliveries that are in the inbox at the same time, so it can only be as big
// as the subscriber's concurrency (AMQP: consumers × prefetch; Kafka: partitions; NATS:
// MaxAckPending and subscribers; GoChannel: subscribers). Deliveries wait up to Linger for a
// batch to fill; each waits for the whole batch (its handlers run one after another on one
// connection) and is acked only after the batch's COMMIT.
type BatchConfig struct {
	// Size is the most deliveries one transaction holds. 0 or 1: off. At most MaxBatchSize.
	// A good value is the subscriber's concurrency divided by 2 to 4, so that one batch
	// gathers while another commits.
	Size int
	// Linger is how long a batch waits, from its first delivery, for Size deliveries before
	// it starts with fewer. Default: DefaultBatchLinger. Every delivery's latency grows by up
	// to Linger; a batch of one runs as an immediate delivery.
	Linger time.Duration
	// Mode is the design used when a handler fails: BatchOptimistic (default) or
	// BatchSavepoints.
	Mode BatchMode
}

func (c *BatchConfig) setDefaults() {
	if c.Size > 1 && c.Linger == 0 {
		c.Linger = DefaultBatchLinger
	}
}

// validate checks c.
func (c BatchConfig) validate() error {
	switch {
	case c.Size < 0 || c.Linger < 0:
		return fmt.Errorf("%w: Batch.Size and Batch.Linger must not be negative", ErrInvalidConfig)
	case c.Size > MaxBatchSize:
		return fmt.Errorf("%w: Batch.Size %d is above MaxBatchSize (%d)", ErrInvalidConfig, c.Size, MaxBatchSize)
	case c.Mode != BatchOptimistic && c.Mode != BatchSavepoints:
		return fmt.Errorf("%w: unknown Batch.Mode %d", ErrInvalidConfig, c.Mode)
	}
	return nil
}

// batcher gathers deliveries into batches, one gathering batch per store: a batch is one
// transaction, so it never spans two databases (Config.Stores).
type batcher struct {
	mu   sync.Mutex
	open map[Store]*batch // gathering, by store; absent when none
}

// batch is a set of deliveries of distinct keys, for one store, that share one transaction.
type batch struct {
	store   Store
	members []*member
	keys    map[Key]struct{}
	timer   *time.Timer
	ran     chan memberRun // a member's handler run, back to the coordinator
}

// member is one delivery in a batch. Its handler runs on its own goroutine (the router's), when
// the coordinator gives it its turn; everything else of the batch runs on the coordinator's.
type member struct {
	d     *delivery
	h     message.HandlerFunc
	batch *batch
	turn  chan turn     // the coordinator: run the handler now
	done  chan struct{} // closed by the coordinator when the member's part is over

	// Set by the coordinator before done is closed.
	f         *failure // nil: settled (d.res.Outcome set)
	immediate bool     // run again alone, on the immediate path

	// Set from the member's last handler run.
	panicked bool
	p        any
}

type turn struct {
	ctx context.Context // the member's context carrying the batch transaction
}

// memberRun is what a member's handler run returned.
type memberRun struct {
	err      error
	panicked bool
	p        any
	goexit   bool
	handler  time.Duration
}

// batchMiddleware is Middleware in the batched mode.
func (i *Inbox) batchMiddleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		reserveStack(len(msg.UUID))
		d := i.newDelivery(msg)
		i.startDelivery(d)
		if d.keyErr != nil || d.braked {
			return i.immediateDelivery(d, h)
		}
		if i.checkProducerTime(d) != nil {
			// Too old or future-dated (TooOldGuard): the immediate path refuses it before
			// any claim, as in the immediate mode.
			return i.immediateDelivery(d, h)
		}
		m := &member{d: d, h: h, turn: make(chan turn), done: make(chan struct{})}
		if !i.batcher.join(i, m) {
			// Its key is in the gathering batch already (a copy delivered at the same
			// moment): alone, it waits on that batch's claim and ends as a duplicate, or runs
			// if the batch does not process it.
			return i.immediateDelivery(d, h)
		}
		return i.awaitBatch(m)
	}
}

// immediateDelivery runs d alone, one transaction, as the immediate mode's Middleware does.
func (i *Inbox) immediateDelivery(d *delivery, h message.HandlerFunc) ([]*message.Message, error) {
	f, panicked, p := i.deliverRecovering(d, h)
	if !panicked {
		return nil, i.settle(d, f)
	}
	return nil, i.settlePanic(d, p)
}

// settlePanic settles a delivery whose handler panicked (its attempt already recorded), and
// panics on unless the message was dead-lettered, as Middleware does.
func (i *Inbox) settlePanic(d *delivery, p any) error {
	err := i.settle(d, &failure{kind: failMessage, err: fmt.Errorf("inbox: handler panicked: %v", p), attempts: d.attempts})
	if d.res.Outcome != OutcomeDeadLettered {
		panic(p)
	}
	i.logger.Error("Handler panicked; message dead-lettered", fmt.Errorf("%v", p), watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
	return err
}

// join adds m to the gathering batch, opening one when none is; it reports false when the
// batch already holds m's key. A batch starts when it is full or Linger after it opened.
func (b *batcher) join(i *Inbox, m *member) bool {
	store := m.d.store
	b.mu.Lock()
	bt := b.open[store]
	if bt == nil {
		bt = &batch{store: store, keys: map[Key]struct{}{}, ran: make(chan memberRun)}
		b.open[store] = bt
		bt.timer = time.AfterFunc(i.cfg.Batch.Linger, func() {
			b.mu.Lock()
			if b.open[store] != bt {
				b.mu.Unlock()
				return
			}
			delete(b.open, store)
			b.mu.Unlock()
			i.runBatch(bt)
		})
	}
	if _, dup := bt.keys[m.d.claim.Key]; dup {
		b.mu.Unlock()
		return false
	}
	bt.keys[m.d.claim.Key] = struct{}{}
	m.batch = bt
	bt.members = append(bt.members, m)
	full := len(bt.members) >= i.cfg.Batch.Size
	if full {
		delete(b.open, store)
		bt.timer.Stop()
	}
	b.mu.Unlock()
	if full {
		go i.runBatch(bt)
	}
	return true
}

// awaitBatch is the member's side: it runs its handler when given its turn, and returns what
// the middleware returns once the batch is over for it.
func (i *Inbox) awaitBatch(m *member) ([]*message.Message, error) {
	for {
		select {
		case t := <-m.turn:
			m.batch.ran <- i.runMember(m, t)
		case <-m.done:
			switch {
			case m.immediate:
				return i.immediateDelivery(m.d, m.h)
			case m.panicked && m.f != nil:
				return nil, i.settlePanic(m.d, m.p)
			}
			return nil, i.settle(m.d, m.f)
		}
	}
}

// runMember runs m's handler (and stores its output) on m's goroutine. A panic is caught and
// reported; runtime.Goexit is reported, then the member settles itself as abandoned once the
// coordinator has taken it out of the batch, and the goroutine exits.
func (i *Inbox) runMember(m *member, t turn) (r memberRun) {
	m.panicked, m.p = false, nil
	normal := false
	var endH func(error) // Config.Tracer's handler phase, ended once
	defer func() {
		if normal {
			return
		}
		if endH != nil {
			endH(errors.New("inbox: the handler panicked or exited"))
		}
		p := recover()
		if p == nil {
			m.batch.ran <- memberRun{goexit: true}
			<-m.done
			_ = i.settle(m.d, &failure{kind: failAbandoned, err: errors.New("inbox: the handler called runtime.Goexit")})
			return
		}
		m.panicked, m.p = true, p
		r = memberRun{panicked: true, p: p, err: fmt.Errorf("handler panicked: %v", p)}
	}()
	hctx, endPhase := i.startPhase(t.ctx, PhaseHandler)
	endH = endPhase
	start := time.Now()
	produced, err := m.h(m.d.handlerMessage(hctx))
	if err == nil && len(produced) > 0 {
		err = i.storeProduced(hctx, produced, m.d.msg)
	}
	r.handler, r.err = time.Since(start), err
	normal = true
	endH(err)
	return r
}

// left is a member taken out of its batch, settled with f once the transaction has ended.
type left struct {
	m *member
	f *failure
}

// finish ends m's part in the batch with f (nil: settled, d.res.Outcome set).
func finish(m *member, f *failure) {
	m.f = f
	close(m.done)
}

// again sends m back to run alone, on the immediate path.
func again(m *member) {
	m.immediate = true
	close(m.done)
}

// runBatch is the coordinator of one batch: it claims every member's key in one transaction,
// gives each claimed member its turn to run its handler, commits, and settles each member;
// transient conflicts (40001, 40P01) retry the whole batch.
func (i *Inbox) runBatch(bt *batch) {
	reserveStack(len(bt.members))
	ms := bt.members

	if len(ms) == 1 {
		again(ms[0]) // nothing to share
		return
	}
	// Keys in one order in every batch: two batches never lock each other's keys in
	// opposite orders.
	slices.SortFunc(ms, func(a, b *member) int { return strings.Compare(a.d.claim.Key.MessageID, b.d.claim.Key.MessageID) })
	backoff := i.cfg.TxRetryBackoff
	for retry := 0; ; retry++ {
		live := ms[:0:0]
		for _, m := range ms {
			if err := m.d.ctx.Err(); err != nil {
				finish(m, &failure{kind: failAbandoned, err: fmt.Errorf("inbox: abandoned while waiting for its batch: %w", err)})
				continue
			}
			live = append(live, m)
		}
		if len(live) == 0 {
			return
		}
		pending, err := i.tryBatch(bt, live)
		if len(pending) == 0 {
			return
		}
		if retry >= i.cfg.MaxTxRetries {
			for _, m := range pending {
				finish(m, &failure{kind: failRetryable, err: err})
			}
			return
		}
		for _, m := range pending {
			m.d.res.TxRetries++
		}
		i.txRetries.Add(uint64(len(pending)))
		i.logger.Debug("Transient conflict, retrying the batch", watermill.LogFields{"members": len(pending), "retry": retry + 1, "error": err.Error()})
		time.Sleep(backoff/2 + rand.N(backoff/2+1))
		backoff = min(backoff*2, i.cfg.MaxTxRetryBackoff)
		ms = pending
	}
}

// batchRun is one transaction of a batch, on the coordinator's goroutine.
type batchRun struct {
	i     *Inbox
	bt    *batch
	tx    contract.BatchTx
	ctx   context.Context // detached from every member's: the batch belongs to none of them
	ms    []*member
	in    []bool // the transaction holds the member's claim
	later []left // members taken out, finished once the transaction has ended
}

// tryBatch runs one transaction for ms. It finishes every member it settles, or sends back to
// the immediate path, and returns the members to retry after a transient conflict, with it.
func (i *Inbox) tryBatch(bt *batch, ms []*member) (retry []*member, retryErr error) {
	ds := make([]contract.Delivery, len(ms))
	for k, m := range ms {
		ds[k] = m.d.claim
	}
	bctx := context.WithoutCancel(ms[0].d.ctx)
	start := time.Now()
	cctx, cancel := context.WithTimeout(bctx, i.cfg.ClaimTimeout)
	tx, claims, err := bt.store.ClaimBatch(cctx, ds)
	cancel()
	for _, m := range ms {
		m.d.res.Claim = time.Since(start)
	}
	if err != nil {
		return i.batchClaimFailed(bt.store, ms, err)
	}
	r := &batchRun{i: i, bt: bt, tx: tx, ctx: bctx, ms: ms, in: make([]bool, len(ms))}
	for k, m := range ms {
		f, run := i.decide(m.d, claims[k])
		switch {
		case run:
			r.in[k] = true
		case f != nil && f.kind == failIsolate:
			// Its key is held by a delivery in flight (or it must run alone): claimed alone,
			// it waits for the key.
			again(m)
		default:
			r.later = append(r.later, left{m, f})
		}
	}
	for k := range ms {
		if r.in[k] {
			if ended, retry, err := r.runMember(k); ended {
				return retry, err
			}
		}
	}
	return r.commit()
}

// batchClaimFailed settles the members of a batch whose claim failed.
func (i *Inbox) batchClaimFailed(s Store, ms []*member, err error) ([]*member, error) {
	err = fmt.Errorf("inbox: batch claim: %w", err)
	switch {
	case s.Classify(err) == contract.Retryable:
		return ms, err
	case !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled):
		// The claim statement failed for the batch (one member's row refused, such as a
		// period without a partition): nothing says whose. Each member runs again alone,
		// where a failure is its own and the others are not nacked for it.
		for _, m := range ms {
			again(m)
		}
	default:
		// Out of time (a key in flight, no free connection): not repeated member by member.
		for _, m := range ms {
			finish(m, &failure{kind: failInfrastructure, err: err})
		}
	}
	return nil, nil
}

// runMember gives member k its turn and deals with how its handler ended. ended reports that
// the batch is over (rolled back, with retry to run again after a transient conflict).
func (r *batchRun) runMember(k int) (ended bool, retry []*member, retryErr error) {
	i, m, d := r.i, r.ms[k], r.ms[k].d
	savepoints := i.cfg.Batch.Mode == BatchSavepoints
	if savepoints {
		if err := r.tx.Savepoint(r.ctx); err != nil {
			r.rollbackAfter(fmt.Errorf("inbox: batch savepoint: %w", err))
			return true, nil, nil
		}
	}
	m.turn <- turn{ctx: r.tx.Context(d.ctx)}
	run := <-r.bt.ran
	d.res.Handler = run.handler
	herr := run.err
	if herr == nil && !run.goexit {
		herr = r.tx.Healthy() // a swallowed failed statement, or the handler ended the transaction
	}
	if herr == nil && !run.goexit {
		return false, nil, nil
	}
	if errors.Is(herr, ErrTxEnded) {
		r.txEnded(k)
		return true, nil, nil
	}
	kind := failAbandoned // runtime.Goexit: the member settles itself as abandoned
	switch {
	case run.goexit:
	case run.panicked:
		kind = failMessage // as in the immediate mode
	default:
		kind = i.failKindOf(d, herr)
	}
	if kind == failRetryable {
		// A conflict between batches (40P01) or a serialization failure: the whole batch again.
		_ = r.tx.Rollback(r.ctx)
		for j, o := range r.ms {
			if r.in[j] {
				retry = append(retry, o)
			}
		}
		r.finishLater()
		return true, retry, herr
	}
	n, err := r.tx.Drop(r.ctx, k, contract.Failure{Counts: kind == failMessage, Error: errText(herr)})
	r.in[k] = false
	if err != nil {
		i.logger.Error("Could not record the failed attempt", err, watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
	}
	d.attempts = n
	if run.goexit {
		close(m.done) // the member settles itself
	} else {
		r.later = append(r.later, left{m, &failure{kind: kind, err: herr, attempts: n}})
	}
	if err != nil || !savepoints || r.tx.Healthy() != nil {
		r.rollbackAfter(err)
		return true, nil, nil
	}
	return false, nil, nil
}

// txEnded ends the batch after member k's handler ended (or tried to end) the shared
// transaction. A COMMIT statement may have committed every claim the batch held: the members
// whose handlers have not run are taken out first (the store deletes their claims), then the
// transaction rolls back and every member still in it, k included, runs again alone, where a
// member that ran is a duplicate if its work committed and runs again if not, and k's own
// misbehaviour is its own failure.
func (r *batchRun) txEnded(k int) {
	for j := k + 1; j < len(r.ms); j++ {
		if r.in[j] {
			if _, err := r.tx.Drop(r.ctx, j, contract.Failure{}); err != nil {
				r.i.logger.Error("Could not take a member out of a batch its neighbour ended", err, watermill.LogFields{"message_uuid": safeUUID(r.ms[j].d.msg.UUID)})
			}
			r.in[j] = false
			again(r.ms[j])
		}
	}
	r.rollbackAfter(nil)
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// commit ends the batch with COMMIT (or ROLLBACK when no member is left in it) and settles
// every member.
func (r *batchRun) commit() ([]*member, error) {
	i, s := r.i, r.bt.store
	defer r.finishLater()
	if !slices.Contains(r.in, true) {
		_ = r.tx.Rollback(r.ctx)
		return nil, nil
	}
	start := time.Now()
	err := r.tx.Commit(r.ctx)
	took := time.Since(start)
	var retry []*member
	for k, m := range r.ms {
		if !r.in[k] {
			continue
		}
		m.d.res.Commit = took
		switch {
		case err == nil:
			m.d.res.Outcome = OutcomeProcessed
			finish(m, nil)
		case s.Classify(err) == contract.Retryable:
			retry = append(retry, m)
		case errors.Is(err, ErrCommitRolledBack) && s.Classify(err) != contract.ConfigFault:
			// Rolled back for certain, and nothing says whose doing it was (a deferred
			// constraint): each member runs again alone, where a failure is its own.
			again(m)
		case errors.Is(err, ErrCommitRolledBack):
			finish(m, &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: batch commit: %w", err)})
		default:
			// The outcome is unknown: nack; the redeliveries are duplicates where it committed.
			finish(m, &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: batch commit (outcome unknown): %w", err)})
		}
	}
	if err != nil {
		i.configurationFault(s, err)
	}
	if len(retry) > 0 {
		return retry, fmt.Errorf("inbox: batch commit: %w", err)
	}
	return nil, nil
}

// rollbackAfter ends the batch after a member left it in the optimistic design (or after a
// store error, cause): the transaction rolls back, the members that left are settled, and
// the others run again alone; a store error nacks them instead.
func (r *batchRun) rollbackAfter(cause error) {
	_ = r.tx.Rollback(r.ctx)
	r.finishLater()
	for k, m := range r.ms {
		if !r.in[k] {
			continue
		}
		if cause != nil {
			finish(m, &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: batch: %w", cause)})
			continue
		}
		again(m)
	}
}

// finishLater finishes the members taken out of the batch, once its transaction has ended.
func (r *batchRun) finishLater() {
	for _, l := range r.later {
		finish(l.m, l.f)
	}
	r.later = nil
}
