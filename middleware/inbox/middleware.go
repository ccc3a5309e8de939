package inbox

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"golang.org/x/sync/semaphore"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/keyrule"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
)

// Stats are counters since the Inbox was created. Each field counts deliveries (one call of
// the middleware by the router, or by a Retry outside it), except TxRetries, which counts
// transaction attempts. Every delivery ends in exactly one Outcome; Processed, Duplicates,
// DeadLettered, DeadLetteredSkips, Failed (both failed outcomes) and the skipped collisions
// add up to the deliveries.
type Stats struct {
	// Processed counts deliveries whose handler ran and whose transaction committed.
	Processed uint64
	// Duplicates counts deliveries skipped because their key was already processed (key
	// collisions are counted in Collisions instead).
	Duplicates uint64
	// Failed counts deliveries the middleware returned an error for (the router nacks).
	Failed uint64
	// InvalidKeys counts deliveries whose key was invalid, or whose route named no store
	// (Config.Stores: a *RouteError), whatever became of them (failed, or dead-lettered when a
	// dead-letter topic is configured).
	InvalidKeys uint64
	// TxRetries counts in-process transaction retries after a Retryable conflict.
	TxRetries uint64
	// DeadLettered counts deliveries published to the dead-letter topic (then acked).
	DeadLettered uint64
	// DeadLetteredSkips counts deliveries of already dead-lettered messages, acked without
	// running the handler. They are not counted as Processed.
	DeadLetteredSkips uint64
	// Collisions counts key collisions (same key, different payload), whatever the policy; a
	// dead-lettered one is also counted in DeadLettered, a rejected one in Failed.
	Collisions uint64
	// InvalidKeyBrakes counts deliveries nacked by the InvalidKeyBrake (also in Failed and
	// InvalidKeys).
	InvalidKeyBrakes uint64
	// Isolated counts deliveries that ran their handler alone among this Inbox's deliveries,
	// because their key had attempts that ended unsettled (crash isolation, docs/design.md;
	// only with a dead-letter topic, in the immediate mode).
	Isolated uint64
}

// Inbox is the transactional inbox middleware for one consumer. It is safe for concurrent use
// by any number of deliveries; each holds one store connection while it runs.
type Inbox struct {
	cfg      Config
	counting bool // a dead-letter topic is configured: attempts are counted durably
	logger   watermill.LoggerAdapter
	keys     keyWindow // recent key validity, for the InvalidKeyBrake
	batcher  *batcher  // set in the batched mode (Config.Batch)
	// gate is the crash-isolation gate (isolation.go): set with attempt counting in the
	// immediate mode.
	gate *semaphore.Weighted

	invalidKeyBrakes, isolated atomic.Uint64

	processed, duplicates, failed, invalidKeys, txRetries atomic.Uint64
	deadLettered, deadLetteredSkips, collisions           atomic.Uint64
}

// New returns an Inbox, or an error wrapping ErrInvalidConfig. A nil logger discards logs.
// Logs never contain payloads or credentials; they carry the message UUID, key length,
// consumer name and error.
func New(cfg Config, logger watermill.LoggerAdapter) (*Inbox, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	// Every field and error text with a control character is quoted (internal/redact.Escape):
	// a key, or an error that quotes one, cannot forge a log line.
	i := &Inbox{cfg: cfg, logger: redact.Escape(logger).With(watermill.LogFields{"consumer_name": cfg.ConsumerName})}
	i.counting = cfg.DeadLetterPublisher != nil
	if cfg.Batch.Size > 1 {
		i.batcher = &batcher{open: map[Store]*batch{}}
	}
	if i.counting && i.batcher == nil {
		i.gate = newGate()
	}
	return i, nil
}

// Stats returns a snapshot of the counters.
func (i *Inbox) Stats() Stats {
	return Stats{
		Processed:   i.processed.Load(),
		Duplicates:  i.duplicates.Load(),
		Failed:      i.failed.Load(),
		InvalidKeys: i.invalidKeys.Load(),
		TxRetries:   i.txRetries.Load(),
		Isolated:    i.isolated.Load(),

		DeadLettered:      i.deadLettered.Load(),
		DeadLetteredSkips: i.deadLetteredSkips.Load(),
		Collisions:        i.collisions.Load(),
		InvalidKeyBrakes:  i.invalidKeyBrakes.Load(),
	}
}

// ConsumerName returns the configured consumer name.
func (i *Inbox) ConsumerName() string { return i.cfg.ConsumerName }

// Middleware wraps h as an idempotent consumer. Per delivery it: extracts and validates the
// key; opens a transaction and claims (message ID, consumer name) in it, insert-first; runs h
// with the transaction reachable from msg.Context() (pgstore.TxFromContext); commits; and only
// then returns nil, so the router acks after the commit.
//
// h receives a copy of the message (UUID, payload and metadata copied, the transaction in its
// context): it may change it freely. The key, the payload hash, every in-process retry, every
// re-entry through an outer Retry and every dead letter use the message as it was received.
//
//   - Key already processed (a duplicate): h does not run, nil is returned and the router
//     acks. A duplicate whose payload differs is a key collision, handled by OnKeyCollision.
//   - h returns an error or panics: the transaction rolls back (no claim remains), the error is
//     returned (the panic propagates) and the router nacks; the redelivery runs h again.
//   - h returns messages: stored through Config.Outbox in the transaction; without one the
//     transaction rolls back and ErrProducedMessages is returned.
//   - Commit fails, including a rollback certain at COMMIT (a swallowed failed statement, a
//     deferred constraint) and a commit whose outcome is unknown: the error is returned and
//     the router nacks; if it had in fact committed, the redelivery is a duplicate.
//   - A Retryable conflict (40001, 40P01) anywhere in the transaction: the whole transaction is
//     retried with a fresh claim up to MaxTxRetries times, then the error is returned.
//   - Invalid key: an *InvalidKeyError (IsPermanent reports true); nothing is claimed and h
//     does not run.
//   - With Config.Stores, a message Config.Route names no store for: a *RouteError
//     (permanent); nothing is claimed on any database and h does not run. Every other step
//     runs on the store of the message's route.
//
// With a dead-letter topic (Config.DeadLetterPublisher), a message is dead-lettered and acked
// after MaxAttempts failed attempts or on a permanent error; see docs/design.md for exactly
// what counts as an attempt.
//
// Middleware has the type of Watermill's message.HandlerMiddleware. It must be innermost:
// package router wraps the handler with it directly; with a plain Watermill router add it
// to the handler last (see docs/design.md, "Middleware order").
//
// With Config.Batch, concurrent deliveries share transactions (group commit): see BatchConfig.
func (i *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	if i.batcher != nil {
		return i.batchMiddleware(h)
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		reserveStack(len(msg.UUID))
		d := i.newDelivery(msg)
		i.startDelivery(d)
		f, panicked, p := i.deliverGated(d, h)
		if !panicked {
			return nil, i.settle(d, f)
		}
		// The try that panicked rolled back and recorded the attempt. A panic that
		// dead-letters the message is acked; any other goes on panicking, so the router's
		// Recoverer (or the router itself) sees it.
		err := i.settle(d, &failure{kind: failMessage, err: fmt.Errorf("inbox: handler panicked: %v", p), attempts: d.attempts})
		if d.res.Outcome != OutcomeDeadLettered {
			panic(p)
		}
		i.logger.Error("Handler panicked; message dead-lettered", fmt.Errorf("%v", p), watermill.LogFields{"message_uuid": safeUUID(msg.UUID)})
		return nil, err
	}
}

// deliverGated is deliverRecovering inside the crash-isolation gate (isolation.go): d holds
// a share of it, or all of it while it runs alone, until its transactions end, whether the
// handler returns, panics or exits the goroutine.
func (i *Inbox) deliverGated(d *delivery, h message.HandlerFunc) (f *failure, panicked bool, p any) {
	if d.keyErr == nil && !d.braked {
		if !i.enterGate(d) {
			return &failure{kind: failAbandoned, err: fmt.Errorf("inbox: waiting for a delivery running alone: %w", d.ctx.Err())}, false, nil
		}
		defer i.leaveGate(d)
	}
	return i.deliverRecovering(d, h)
}

// deliverRecovering is deliver with the handler's panic caught: only the delivery's own code
// runs under the recover, never settle (so a panicking Observer cannot settle a delivery
// twice).
func (i *Inbox) deliverRecovering(d *delivery, h message.HandlerFunc) (f *failure, panicked bool, p any) {
	defer func() {
		if !panicked {
			return
		}
		if p = recover(); p == nil {
			// runtime.Goexit: the goroutine ends without returning; settle it here, as
			// abandoned, so the delivery still has its one outcome.
			_ = i.settle(d, &failure{kind: failAbandoned, err: errors.New("inbox: the handler called runtime.Goexit")})
		}
	}()
	panicked = true
	f = i.deliver(d, h)
	panicked = false
	return f, false, nil
}

// delivery is one call of the middleware: the message as received, its key, and what
// happened to it so far.
type delivery struct {
	msg    *message.Message  // as received; never handed to the handler
	ctx    context.Context   // msg.Context() at entry
	claim  contract.Delivery // what the store is asked
	store  Store             // the store claim is asked of (storeFor); nil when keyErr is set
	keyErr error             // the key or the route is invalid (claim.Key is empty)
	braked bool              // invalid, during an invalid-key flood (InvalidKeyBrake)
	// gate is what the delivery holds of the crash-isolation gate; isolationTried is set
	// once it asked to run alone (isolation.go).
	gate           gateHold
	isolationTried bool
	isolatedRan    bool // counted in Stats.Isolated
	attempts       int  // the key's attempt count as the store last reported it
	res            Result
	traceEnd       func(Result) // Config.Tracer's end of the delivery, until called
	// payloadHash backs claim.PayloadHash (SHA-256 of the payload as received).
	payloadHash [sha256.Size]byte
}

func (i *Inbox) newDelivery(msg *message.Message) *delivery {
	d := &delivery{msg: msg, ctx: msg.Context()}
	d.res.MessageUUID = msg.UUID
	d.claim.Isolation = i.cfg.Isolation
	d.claim.FinishTimeout = i.cfg.FinishTimeout
	select {
	case <-msg.Acked():
		d.keyErr = ErrAckedBeforeHandler
		return d
	default:
	}
	source := i.cfg.KeyExtractor.Source()
	key, err := i.cfg.KeyExtractor.ExtractKey(msg)
	if err != nil {
		d.keyErr = Permanent(fmt.Errorf("inbox: extracting key from %s: %w", source, err))
	} else if err := ValidateKey(source, key); err != nil {
		d.keyErr = err
	} else {
		d.claim.Key = Key{MessageID: key, ConsumerName: i.cfg.ConsumerName}
		d.keyErr = i.placeClaim(msg, source, d)
	}
	if !i.cfg.InvalidKeyBrake.Disabled {
		brake, warn := i.keys.observe(i.cfg.InvalidKeyBrake, d.keyErr != nil)
		if brake {
			d.braked = true
			if warn {
				i.logger.Error("Invalid-key flood: nacking instead of dead-lettering until the key configuration is fixed", ErrInvalidKeyFlood,
					watermill.LogFields{"source": source, "window": i.cfg.InvalidKeyBrake.Window})
			}
		}
	}
	if d.keyErr != nil {
		d.claim.Key, d.store = Key{}, nil
		i.invalidKeys.Add(1)
		why := "Message refused: invalid key"
		if errors.Is(d.keyErr, ErrUnroutable) {
			why = "Message refused: no store for its route"
		}
		i.logger.Error(why, d.keyErr, watermill.LogFields{"message_uuid": safeUUID(msg.UUID)})
		return d
	}
	d.res.Key = d.claim.Key
	d.claim.CorrelationID = validOrEmpty(wmmiddleware.MessageCorrelationID(msg))
	if i.cfg.MessageTypeKey != "-" {
		d.claim.MessageType = validOrEmpty(msg.Metadata.Get(i.cfg.MessageTypeKey))
	}
	d.payloadHash = sha256.Sum256(msg.Payload) // held in d: no allocation of its own
	d.claim.PayloadHash = d.payloadHash[:]
	if i.counting {
		d.claim.MaxAttempts = i.cfg.MaxAttempts
		d.claim.CountFirst = i.cfg.Redelivery == nil || i.cfg.Redelivery(msg) != FirstDelivery
	}
	return d
}

// handlerMessage returns the copy of the received message that the handler gets, with ctx.
func (d *delivery) handlerMessage(ctx context.Context) *message.Message {
	m := message.NewMessage(d.msg.UUID, bytes.Clone(d.msg.Payload))
	maps.Copy(m.Metadata, d.msg.Metadata) // into the map NewMessage made: no second map
	m.SetContext(ctx)
	return m
}

// failKind classifies why a transaction did not settle the delivery.
type failKind int

const (
	// failMessage: the message's own failure (the handler's error or panic, a rollback
	// certain at COMMIT, a permanent error): it uses up an attempt.
	failMessage failKind = iota + 1
	// failRetryable: a transient conflict (40001, 40P01); retried in process.
	failRetryable
	// failInfrastructure: the claim failed, the commit's outcome is unknown, or the store
	// reports a configuration fault (FaultClassifier): not the message's failure.
	failInfrastructure
	// failAbandoned: the delivery's own consumer is shutting down (its context was
	// cancelled): not the message's failure.
	failAbandoned
	// failIsolate: the key has attempts that ended unsettled; the claim and this delivery's
	// count were taken back so that it runs again, alone (isolation.go). Never settled.
	failIsolate
)

// failure is a transaction that did not settle the delivery; nil means settled (d.res).
type failure struct {
	kind     failKind
	err      error
	attempts int // the attempt count after recording a failMessage, when counted
}

// deliver runs the delivery's transactions until one settles it or a failure is final.
func (i *Inbox) deliver(d *delivery, h message.HandlerFunc) *failure {
	if d.braked {
		i.invalidKeyBrakes.Add(1)
		select {
		case <-time.After(i.cfg.InvalidKeyBrake.Pause):
		case <-d.ctx.Done():
		}
		return &failure{kind: failInfrastructure, err: fmt.Errorf("%w (%v)", ErrInvalidKeyFlood, d.keyErr)}
	}
	if d.keyErr != nil {
		return &failure{kind: failMessage, err: d.keyErr}
	}
	if f := i.checkProducerTime(d); f != nil {
		return f // too old or future-dated (TooOldGuard): before the claim, so no attempt counts
	}
	backoff := i.cfg.TxRetryBackoff
	for retry := 0; ; retry++ {
		f := i.try(d, h)
		if f != nil && f.kind == failIsolate {
			if !i.isolate(d) {
				return &failure{kind: failAbandoned, err: fmt.Errorf("inbox: waiting to run alone: %w", d.ctx.Err())}
			}
			retry-- // not a conflict: no retry used
			continue
		}
		if f == nil || f.kind != failRetryable || retry >= i.cfg.MaxTxRetries {
			return f
		}
		i.txRetries.Add(1)
		d.res.TxRetries++
		i.logger.Debug("Transient conflict, retrying the transaction", watermill.LogFields{
			"message_uuid": safeUUID(d.msg.UUID), "retry": retry + 1, "error": f.err.Error(),
		})
		pause := backoff/2 + rand.N(backoff/2+1)
		select {
		case <-time.After(pause):
		case <-d.ctx.Done():
			return &failure{kind: failAbandoned, err: errors.Join(f.err, d.ctx.Err())}
		}
		backoff = min(backoff*2, i.cfg.MaxTxRetryBackoff)
	}
}

// try runs one transaction: claim, handler, commit. It returns nil when it settled the
// delivery (d.res.Outcome is set), or the failure.
func (i *Inbox) try(d *delivery, h message.HandlerFunc) *failure {
	start := time.Now()
	phaseCtx, endClaim := i.startPhase(d.ctx, PhaseClaim)
	claimCtx, cancel := context.WithTimeout(phaseCtx, i.cfg.ClaimTimeout)
	q := d.claim
	q.Isolate = i.gate != nil && d.gate == gateShared && !d.isolationTried
	tx, c, err := d.store.Claim(claimCtx, q)
	cancel()
	d.res.Claim = time.Since(start)
	endClaim(err)
	if err != nil {
		err = fmt.Errorf("inbox: claim: %w", err)
		i.configurationFault(d.store, err) // a missing privilege or table is logged at ERROR
		return &failure{kind: failInfrastructure, err: err}
	}
	if f, run := i.decide(d, c); !run {
		return f
	}
	return i.run(d, h, tx)
}

// decide applies a claim's decision, in the immediate and the batched mode alike. It reports
// whether the handler runs; otherwise the delivery is settled (d.res.Outcome set, f nil) or
// failed with f.
func (i *Inbox) decide(d *delivery, c contract.Claim) (f *failure, run bool) {
	d.attempts = c.Attempts
	switch c.Decision {
	case contract.Run:
		return nil, true
	case contract.Duplicate:
		d.res.Outcome = OutcomeDuplicate
		d.res.DuplicateAge = since(c.StoredAt)
	case contract.Collision:
		d.res.Outcome = OutcomeCollision
		d.res.DuplicateAge = since(c.StoredAt)
	case contract.DeadLettered:
		d.res.Outcome = OutcomeDeadLetteredSkip
	case contract.Exhausted:
		d.res.Reason = exhaustedReason(c.Attempts, i.cfg.MaxAttempts, c.LastError)
		return &failure{kind: failMessage, err: Permanent(errors.New(d.res.Reason)), attempts: c.Attempts}, false
	case contract.RunAlone:
		return &failure{kind: failIsolate}, false
	default:
		return &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: claim: unknown decision %d", c.Decision)}, false
	}
	return nil, false
}

// run runs the handler of a claimed delivery in tx, then commits, or records the failure.
func (i *Inbox) run(d *delivery, h message.HandlerFunc, tx contract.Tx) *failure {
	settled := false
	var endHandler func(error)
	defer func() {
		if settled {
			return
		}
		if endHandler != nil {
			endHandler(errors.New("inbox: the handler panicked or exited"))
		}
		// Reached on a handler panic: end the transaction, record the attempt, and panic on.
		// A nil recover is runtime.Goexit (t.FailNow in a test's handler): no failure of the
		// message; end the transaction and let the goroutine exit.
		p := recover()
		f := contract.Failure{Counts: p != nil, Error: fmt.Sprintf("handler panicked: %v", p)}
		d.attempts, _ = tx.Fail(d.ctx, f)
		if p != nil {
			panic(p)
		}
	}()

	handlerCtx, endH := i.startPhase(d.ctx, PhaseHandler)
	endHandler = endH
	txCtx := tx.Context(handlerCtx)
	if d.gate == gateExclusive && !d.isolatedRan {
		d.isolatedRan = true
		d.res.Isolated = true
		i.isolated.Add(1)
	}
	hstart := time.Now()
	produced, herr := h(d.handlerMessage(txCtx))
	if herr == nil && len(produced) > 0 {
		herr = i.storeProduced(txCtx, produced, d.msg)
	}
	d.res.Handler = time.Since(hstart)
	settled = true
	endH(herr)

	if herr != nil {
		return i.fail(d, tx, i.failKindOf(d, herr), herr)
	}
	cstart := time.Now()
	_, endCommit := i.startPhase(d.ctx, PhaseCommit)
	err := tx.Commit(d.ctx)
	d.res.Commit = time.Since(cstart)
	endCommit(err)
	if err == nil {
		d.res.Outcome = OutcomeProcessed
		return nil
	}
	kind := i.commitKindOf(d.store, err)
	if kind == failInfrastructure && !errors.Is(err, ErrCommitRolledBack) && d.store.Classify(err) != contract.ConfigFault {
		// The outcome is unknown: it may have committed. Nack, never dead-letter; the
		// redelivery is a duplicate if it did.
		return i.fail(d, tx, kind, fmt.Errorf("inbox: commit (outcome unknown): %w", err))
	}
	return i.fail(d, tx, kind, fmt.Errorf("inbox: commit: %w", err))
}

// since is the age of t, zero for a zero t (a store that does not say) or one in the future.
func since(t time.Time) time.Duration {
	if t.IsZero() {
		return 0
	}
	return max(time.Since(t), 0)
}

// fail ends a transaction that did not commit (or records after a failed commit), counting
// an attempt when the failure is the message's own.
func (i *Inbox) fail(d *delivery, tx contract.Tx, kind failKind, err error) *failure {
	n, ferr := tx.Fail(d.ctx, contract.Failure{Counts: kind == failMessage, Error: err.Error()})
	if ferr != nil {
		i.logger.Error("Could not record the failed attempt", ferr, watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
	}
	d.attempts = n
	return &failure{kind: kind, err: err, attempts: n}
}

// failKindOf classifies a handler (or outbox) error of delivery d.
func (i *Inbox) failKindOf(d *delivery, herr error) failKind {
	switch {
	case d.store.Classify(herr) == contract.Retryable:
		return failRetryable
	case i.configurationFault(d.store, herr), errors.Is(herr, ErrProducedMessages), errors.Is(herr, ErrNoPublishTopic):
		// The deployment's fault (a missing privilege or table, no Outbox, no publish
		// topic): no message can succeed until it is fixed.
		return failInfrastructure
	case errors.Is(d.ctx.Err(), context.Canceled):
		// The consumer is shutting down (the router cancels message contexts on Close):
		// not the message's failure.
		return failAbandoned
	}
	return failMessage
}

// commitKindOf classifies a commit error: a transient conflict is retried, a configuration
// fault or an unknown outcome is not the message's failure, a rollback certain at COMMIT is.
func (i *Inbox) commitKindOf(s Store, err error) failKind {
	switch {
	case s.Classify(err) == contract.Retryable:
		return failRetryable
	case i.configurationFault(s, err):
		return failInfrastructure
	case errors.Is(err, ErrCommitRolledBack):
		return failMessage
	}
	return failInfrastructure
}

// configurationFault reports whether store s classifies err as the deployment's fault, and
// logs it at ERROR when so.
func (i *Inbox) configurationFault(s Store, err error) bool {
	if s.Classify(err) != contract.ConfigFault {
		return false
	}
	i.logger.Error("Configuration fault: the delivery is nacked without using up an attempt; no message can succeed until it is fixed", err, nil)
	return true
}

// settle turns the delivery's last result into its one outcome: it dead-letters when that is
// due, updates the counters, logs, tells the Observer, and returns what the middleware
// returns (nil: the router acks).
func (i *Inbox) settle(d *delivery, f *failure) error {
	if f != nil {
		i.settleFailure(d, f)
	} else if d.res.Outcome == OutcomeCollision {
		i.collision(d)
	}
	switch d.res.Outcome {
	case OutcomeProcessed:
		i.processed.Add(1)
	case OutcomeDuplicate:
		i.duplicates.Add(1)
		i.logger.Debug("Duplicate message skipped", watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
	case OutcomeDeadLetteredSkip:
		i.deadLetteredSkips.Add(1)
		i.logger.Info("Dead-lettered message delivered again; skipped", watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
	case OutcomeDeadLettered:
		i.deadLettered.Add(1)
	case OutcomeFailedRetryable, OutcomeFailedFinal:
		i.failed.Add(1)
	}
	i.endDelivery(d)
	if i.cfg.Observer != nil {
		i.observe(d)
	}
	if d.res.Outcome.Acked() {
		return nil
	}
	return d.res.Err
}

// observe calls the Observer; a panic in it is logged, never taken for the handler's.
func (i *Inbox) observe(d *delivery) {
	defer func() {
		if p := recover(); p != nil {
			i.logger.Error("Observer panicked", fmt.Errorf("%v", p), watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
		}
	}()
	i.cfg.Observer.ObserveDelivery(d.ctx, d.res)
}

// abandonedWhy is the log line of an abandoned delivery: its context was cancelled (the
// router shutting down), its deadline passed (a Timeout middleware in front of the inbox, while
// it waited for a delivery running alone or for its back-off), or the handler left its
// goroutine (runtime.Goexit).
func abandonedWhy(ctx context.Context) string {
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return "Delivery abandoned: its context's deadline passed before its handler could settle it; not counted as an attempt"
	case ctx.Err() != nil:
		return "Delivery abandoned: the consumer is shutting down; not counted as an attempt"
	}
	return "Delivery abandoned: the handler left its goroutine (runtime.Goexit); not counted as an attempt"
}

// settleFailure decides what a failure becomes: a dead letter, or an error for the router.
func (i *Inbox) settleFailure(d *delivery, f *failure) {
	if f.err == nil {
		// Never reached by design (every failure names its error); a failure without one must
		// still nack, never ack.
		f.err = errors.New("inbox: delivery not settled")
	}
	d.res.Err = f.err
	d.res.Attempts = d.attempts
	if f.kind != failMessage {
		d.res.Outcome = OutcomeFailedRetryable
		if f.kind == failAbandoned {
			i.logger.Info(abandonedWhy(d.ctx), watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
		}
		return
	}
	permanent := IsPermanent(f.err)
	if !i.counting {
		if permanent {
			d.res.Outcome = OutcomeFailedFinal
		} else {
			d.res.Outcome = OutcomeFailedRetryable
		}
		return
	}
	d.res.Attempts = f.attempts
	keyed := d.keyErr == nil
	switch {
	case d.res.Reason != "": // exhausted before the handler ran
	case permanent:
		d.res.Reason = "permanent error: " + f.err.Error()
	case keyed && f.attempts >= i.cfg.MaxAttempts:
		d.res.Reason = fmt.Sprintf("failed %d of %d attempts; last error: %s", f.attempts, i.cfg.MaxAttempts, f.err)
	default:
		d.res.Outcome = OutcomeFailedRetryable
		return
	}
	if err := i.deadLetter(d, keyed); err != nil {
		d.res.Err = err
		d.res.Outcome = OutcomeFailedFinal
		return
	}
	d.res.Outcome = OutcomeDeadLettered
}

// collision applies OnKeyCollision to a duplicate whose payload hash differs.
func (i *Inbox) collision(d *delivery) {
	i.collisions.Add(1)
	d.res.Collision = true
	i.logger.Error("Key collision: key already processed with a different payload", ErrKeyCollision,
		watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID), "policy": i.cfg.OnKeyCollision})
	switch {
	case i.cfg.OnKeyCollision == CollisionSkip:
		d.res.Outcome = OutcomeCollision // acked like a duplicate; counted in Collisions only
	case i.cfg.OnKeyCollision == CollisionDeadLetter && i.counting:
		// Not marked as dead-lettered: the key belongs to the message that was processed.
		d.res.Reason = ErrKeyCollision.Error()
		d.res.Err = ErrKeyCollision
		if err := i.deadLetter(d, false); err != nil {
			d.res.Err = err
			d.res.Outcome = OutcomeFailedFinal
			return
		}
		d.res.Outcome = OutcomeDeadLettered
	default:
		d.res.Err = ErrKeyCollision
		d.res.Outcome = OutcomeFailedFinal
	}
}

// storeProduced writes a handler's output to the outbox in the inbox transaction. Produced
// messages without a correlation ID get the received message's, as Watermill's
// CorrelationID middleware would have given them had the router published them.
func (i *Inbox) storeProduced(txCtx context.Context, produced []*message.Message, received *message.Message) error {
	if i.cfg.Outbox == nil {
		return ErrProducedMessages
	}
	topic := message.PublishTopicFromCtx(txCtx)
	if topic == "" {
		topic, _ = txCtx.Value(publishTopicKey{}).(string)
	}
	if topic == "" {
		return ErrNoPublishTopic
	}
	for _, m := range produced {
		i.inject(txCtx, PhaseHandler, m)
	}
	if cid := wmmiddleware.MessageCorrelationID(received); cid != "" {
		for _, m := range produced {
			if m != nil && wmmiddleware.MessageCorrelationID(m) == "" {
				wmmiddleware.SetCorrelationID(cid, m)
			}
		}
	}
	if err := i.cfg.Outbox.Store(txCtx, topic, produced); err != nil {
		return fmt.Errorf("inbox: storing %d produced messages in the outbox: %w", len(produced), err)
	}
	return nil
}

type publishTopicKey struct{}

// ContextWithPublishTopic returns ctx naming topic as the handler's publish topic, for a
// handler that returns messages and runs without Watermill's router (which sets it for
// handlers added with AddHandler): a test, or a hand-written consumer loop. The inbox stores
// the returned messages in the outbox for that topic.
func ContextWithPublishTopic(ctx context.Context, topic string) context.Context {
	return context.WithValue(ctx, publishTopicKey{}, topic)
}

// validOrEmpty drops optional metadata that PostgreSQL text cannot hold or that is unbounded.
func validOrEmpty(s string) string {
	if !keyrule.Text(s) {
		return ""
	}
	return s
}

// safeUUID returns the message UUID for logs and error strings (keyrule.SafeID).
func safeUUID(id string) string { return keyrule.SafeID(id) }
