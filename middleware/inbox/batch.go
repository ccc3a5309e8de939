package inbox

import (
	"bytes"
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

// validate checks c against the store; store is the Config's.
func (c BatchConfig) validate(store Store) error {
	switch {
	case c.Size < 0 || c.Linger < 0:
		return fmt.Errorf("%w: Batch.Size and Batch.Linger must not be negative", ErrInvalidConfig)
	case c.Size > MaxBatchSize:
		return fmt.Errorf("%w: Batch.Size %d is above MaxBatchSize (%d)", ErrInvalidConfig, c.Size, MaxBatchSize)
	case c.Mode != BatchOptimistic && c.Mode != BatchSavepoints:
		return fmt.Errorf("%w: unknown Batch.Mode %d", ErrInvalidConfig, c.Mode)
	}
	bs, ok := store.(BatchStore)
	if c.Size > 1 && !ok {
		return fmt.Errorf("%w: Batch.Size %d needs a Store that implements BatchStore (group commit); %T does not", ErrInvalidConfig, c.Size, store)
	}
	if c.Size > 1 {
		if err := bs.BatchSupported(); err != nil {
			return fmt.Errorf("%w: Batch.Size %d: %w", ErrInvalidConfig, c.Size, err)
		}
	}
	return nil
}

// errSwallowed is the failure of a member whose handler returned nil although one of its
// statements failed (the transaction is aborted): in the immediate mode COMMIT would answer
// ROLLBACK for it.
var errSwallowed = errors.New("inbox: a statement of the handler failed but the handler returned nil; the transaction is aborted")

// batcher gathers deliveries into batches.
type batcher struct {
	store BatchStore
	mu    sync.Mutex
	open  *batch // gathering; nil when none
}

// batch is a set of deliveries of distinct keys that share one transaction.
type batch struct {
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
	tx  BatchTx
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
	b.mu.Lock()
	bt := b.open
	if bt == nil {
		bt = &batch{keys: map[Key]struct{}{}, ran: make(chan memberRun)}
		b.open = bt
		bt.timer = time.AfterFunc(i.cfg.Batch.Linger, func() {
			b.mu.Lock()
			if b.open != bt {
				b.mu.Unlock()
				return
			}
			b.open = nil
			b.mu.Unlock()
			i.runBatch(bt)
		})
	}
	if _, dup := bt.keys[m.d.params.Key]; dup {
		b.mu.Unlock()
		return false
	}
	bt.keys[m.d.params.Key] = struct{}{}
	m.batch = bt
	bt.members = append(bt.members, m)
	full := len(bt.members) >= i.cfg.Batch.Size
	if full {
		b.open = nil
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
		err = i.storeProduced(hctx, t.tx, produced, m.d.msg)
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
	slices.SortFunc(ms, func(a, b *member) int { return strings.Compare(a.d.params.Key.MessageID, b.d.params.Key.MessageID) })
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

// tryBatch runs one transaction for ms. It finishes every member it settles, or sends back to
// the immediate path, and returns the members to retry after a transient conflict, with it.
func (i *Inbox) tryBatch(bt *batch, ms []*member) (retry []*member, retryErr error) {
	counted := i.attempts != nil
	p := BatchClaimParams{Counted: counted, Isolation: i.cfg.Isolation, FinishTimeout: i.cfg.FinishTimeout}
	for _, m := range ms {
		p.Claims = append(p.Claims, CountedClaimParams{ClaimParams: m.d.params, CountFirst: m.d.countFirst && !m.d.counted, CountLimit: i.cfg.MaxAttempts})
	}
	// The batch belongs to no single delivery: its work is detached from each member's
	// context (a member cancelled meanwhile is settled by its own result) and bounded here.
	bctx := context.WithoutCancel(ms[0].d.ctx)
	start := time.Now()
	cctx, cancel := context.WithTimeout(bctx, i.cfg.ClaimTimeout)
	tx, results, err := i.batcher.store.ClaimBatch(cctx, p)
	cancel()
	claimed := time.Since(start)
	for _, m := range ms {
		m.d.res.Claim = claimed
	}
	if err != nil {
		if i.cfg.Store.Retryable(err) {
			return ms, fmt.Errorf("inbox: batch claim: %w", err)
		}
		if !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled) {
			// The claim statement failed for the batch (one member's row refused, such as
			// a period without a partition): nothing says whose. Each member runs again
			// alone, where a failure is its own and the others are not nacked for it.
			// A claim that ran out of time (a key in flight, no free connection) is not
			// repeated member by member: they are nacked.
			for _, m := range ms {
				again(m)
			}
			return nil, nil
		}
		for _, m := range ms {
			finish(m, &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: batch claim: %w", err)})
		}
		return nil, nil
	}

	// in: members whose claim the transaction holds; later: members taken out of the batch,
	// settled once the transaction has ended.
	in := make([]bool, len(ms))
	var later []left
	abort := func(cause error) {
		// The transaction cannot go on (a store error): roll back; everyone still in it is
		// nacked.
		rerr := tx.Rollback(bctx)
		for k, m := range ms {
			if in[k] {
				if rerr == nil {
					m.d.counted = false // Rollback took its count back
				}
				finish(m, &failure{kind: failInfrastructure, err: cause})
			}
		}
		for _, l := range later {
			finish(l.m, l.f)
		}
	}
	for k, m := range ms {
		d, res := m.d, results[k]
		if res.Counted {
			d.counted = true
		}
		switch {
		case res.Record.DeadLettered:
			d.res.Outcome = OutcomeDeadLetteredSkip
			finish(m, nil)
			continue
		case !res.Claimed:
			d.counted = false // the store takes a duplicate's count back
			// A store may keep a prefix of the hash (ClaimResult.StoredPayloadHash).
			if len(res.StoredPayloadHash) > 0 && !bytes.HasPrefix(d.params.PayloadHash, res.StoredPayloadHash) {
				d.res.Outcome = OutcomeCollision
			} else {
				d.res.Outcome = OutcomeDuplicate
			}
			finish(m, nil)
			continue
		}
		in[k] = true
		d.attempts = res.Record.Attempts
		if earlier := res.Record.Attempts - b2i(d.counted); counted && earlier >= i.cfg.MaxAttempts {
			n, err := tx.Drop(bctx, k, FailParams{AttemptsDelta: -b2i(d.counted)})
			in[k] = false
			if err != nil {
				later = append(later, left{m, &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: release the claim of an exhausted message: %w", err)}})
				abort(fmt.Errorf("inbox: batch: %w", err))
				return nil, nil
			}
			d.counted, d.attempts = false, n
			d.res.Reason = exhaustedReason(earlier, i.cfg.MaxAttempts, res.Record.LastError)
			later = append(later, left{m, &failure{kind: failMessage, err: Permanent(errors.New(d.res.Reason)), attempts: n}})
		}
	}

	savepoints := i.cfg.Batch.Mode == BatchSavepoints
	for k, m := range ms {
		if !in[k] {
			continue
		}
		d := m.d
		if savepoints {
			if err := tx.Savepoint(bctx); err != nil {
				abort(fmt.Errorf("inbox: batch savepoint: %w", err))
				return nil, nil
			}
		}
		m.turn <- turn{ctx: tx.Context(d.ctx), tx: tx}
		r := <-bt.ran
		d.res.Handler = r.handler
		herr := r.err
		if r.goexit {
			// Not the message's failure: the member settles itself as abandoned.
			n, err := tx.Drop(bctx, k, FailParams{AttemptsDelta: -b2i(d.counted)})
			in[k] = false
			if err == nil {
				d.counted, d.attempts = false, n
			}
			close(m.done) // the member settles itself
			if err != nil || !savepoints {
				return i.rollbackAfter(tx, bctx, ms, in, later, err)
			}
			continue
		}
		if herr == nil && tx.Aborted() {
			herr = errSwallowed
		}
		if herr == nil {
			continue
		}
		kind := i.failKindOf(d, herr)
		if r.panicked {
			kind = failMessage // as in the immediate mode: a panic is always an attempt
		}
		if kind == failRetryable {
			// A conflict between batches (40P01) or a serialization failure: the whole
			// batch again.
			rerr := tx.Rollback(bctx)
			for j, o := range ms {
				if in[j] {
					if rerr == nil {
						o.d.counted = false
					}
					retry = append(retry, o)
				}
			}
			for _, l := range later {
				finish(l.m, l.f)
			}
			return retry, herr
		}
		fp := FailParams{AttemptsDelta: 1 - b2i(d.counted), Error: herr.Error()}
		if kind != failMessage {
			fp = FailParams{AttemptsDelta: -b2i(d.counted)}
		}
		if kind == failMessage && !counted {
			fp = FailParams{}
		}
		n, err := tx.Drop(bctx, k, fp)
		in[k] = false
		f := &failure{kind: kind, err: herr}
		if err != nil {
			i.logger.Error("Could not record the failed attempt", err, watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
			n = d.attempts + fp.AttemptsDelta
		}
		d.counted, d.attempts, f.attempts = false, n, n
		later = append(later, left{m, f})
		if err != nil || !savepoints {
			return i.rollbackAfter(tx, bctx, ms, in, later, err)
		}
	}

	anyIn := slices.Contains(in, true)
	cstart := time.Now()
	var err2 error
	if anyIn {
		err2 = tx.Commit(bctx)
	} else {
		err2 = tx.Rollback(bctx)
	}
	took := time.Since(cstart)
	defer func() {
		for _, l := range later {
			finish(l.m, l.f)
		}
	}()
	if !anyIn {
		return nil, nil
	}
	for k, m := range ms {
		if in[k] {
			m.d.res.Commit = took
		}
	}
	switch {
	case err2 == nil:
		for k, m := range ms {
			if in[k] {
				m.d.counted = false // the commit cleared the attempt record
				m.d.res.Outcome = OutcomeProcessed
				finish(m, nil)
			}
		}
		return nil, nil
	case i.cfg.Store.Retryable(err2):
		for k, m := range ms {
			if in[k] {
				m.d.counted = false // rolled back for certain: the store took the counts back
				retry = append(retry, m)
			}
		}
		return retry, fmt.Errorf("inbox: batch commit: %w", err2)
	case errors.Is(err2, ErrCommitRolledBack):
		// Rolled back for certain, and nothing says whose doing it was (a deferred
		// constraint): each member runs again alone, where a failure is its own.
		configFault := i.configurationFault(err2)
		for k, m := range ms {
			if in[k] {
				m.d.counted = false
				if configFault {
					finish(m, &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: batch commit: %w", err2)})
				} else {
					again(m)
				}
			}
		}
		return nil, nil
	}
	// The outcome is unknown: nack every member; the redeliveries are duplicates where it
	// committed.
	for k, m := range ms {
		if in[k] {
			finish(m, &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: batch commit (outcome unknown): %w", err2)})
		}
	}
	return nil, nil
}

// rollbackAfter ends the batch after a member left it in the optimistic design (or after a
// store error): the transaction rolls back, the members that left are settled, and the
// others run again alone; a store error (cause) nacks them instead.
func (i *Inbox) rollbackAfter(tx BatchTx, ctx context.Context, ms []*member, in []bool, later []left, cause error) ([]*member, error) {
	rerr := tx.Rollback(ctx)
	for _, l := range later {
		finish(l.m, l.f)
	}
	for k, m := range ms {
		if !in[k] {
			continue
		}
		if rerr == nil {
			m.d.counted = false // Rollback took its count back
		}
		if cause != nil {
			finish(m, &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: batch: %w", cause)})
			continue
		}
		again(m)
	}
	return nil, nil
}

// failKindOf classifies a handler (or outbox) error of delivery d, as failTx does.
func (i *Inbox) failKindOf(d *delivery, herr error) failKind {
	switch {
	case i.cfg.Store.Retryable(herr):
		return failRetryable
	case i.configurationFault(herr), errors.Is(herr, ErrProducedMessages), errors.Is(herr, ErrNoPublishTopic):
		return failInfrastructure
	case errors.Is(d.ctx.Err(), context.Canceled):
		return failAbandoned
	}
	return failMessage
}
