package inbox

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"weak"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"golang.org/x/sync/semaphore"

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
	// InvalidKeys counts deliveries whose key was invalid, whatever became of them (failed,
	// or dead-lettered when a dead-letter topic is configured).
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
	// entered holds the message objects the immediate inbox has run a delivery of (weak
	// pointers, deleted once a message is garbage): a second call with one is a re-entry
	// (an outer Retry), which reads the attempt record.
	entered sync.Map

	cfg      Config
	attempts AttemptStore // set when a dead-letter topic is configured
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
	if cfg.DeadLetterPublisher != nil {
		i.attempts = cfg.Store.(AttemptStore) // checked by Validate
	}
	if cfg.Batch.Size > 1 {
		i.batcher = &batcher{store: cfg.Store.(BatchStore)} // checked by Validate
	}
	if i.attempts != nil && i.batcher == nil {
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
		// A first delivery is claimed without reading the key's attempt record, the first time
		// the inbox sees this message only: an outer Retry calls it again with the same
		// message, whose broker signal still says first delivery, after a try that may have
		// recorded a failure (docs/design.md, "What a first delivery skips"). Known by the
		// message object, not by its context (Retry's ResetContextOnRetry, the documented
		// order, restores it), and tracked only for such deliveries: the plain inbox and a
		// counted delivery read nothing of it.
		if i.attempts != nil && !d.countFirst {
			wp := weak.Make(msg)
			if _, reentry := i.entered.LoadOrStore(wp, struct{}{}); !reentry {
				runtime.AddCleanup(msg, func(wp weak.Pointer[message.Message]) { i.entered.Delete(wp) }, wp)
				d.noRecord = true
			}
		}
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
	msg        *message.Message // as received; never handed to the handler
	ctx        context.Context  // msg.Context() at entry
	params     ClaimParams
	keyErr     error // the key is invalid (params.Key is empty)
	braked     bool  // invalid, during an invalid-key flood (InvalidKeyBrake)
	countFirst bool  // count durably before the first claim (a possible redelivery)
	noRecord   bool  // claim without reading the attempt record (CountedClaimParams.NoRecord)
	// gate is what the delivery holds of the crash-isolation gate; isolationTried is set
	// once it asked to run alone (isolation.go).
	gate           gateHold
	isolationTried bool
	isolatedRan    bool // counted in Stats.Isolated
	counted        bool // this delivery's count is in the store
	attempts       int  // the attempt count after the last recorded change, when counted
	res            Result
	traceEnd       func(Result) // Config.Tracer's end of the delivery, until called
	// payloadHash backs params.PayloadHash (SHA-256 of the payload as received).
	payloadHash [sha256.Size]byte
}

func (i *Inbox) newDelivery(msg *message.Message) *delivery {
	d := &delivery{msg: msg, ctx: msg.Context()}
	d.res.MessageUUID = msg.UUID
	d.params.Isolation = i.cfg.Isolation
	d.params.FinishTimeout = i.cfg.FinishTimeout
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
	} else if err := i.checkClaim(msg, source, key, &d.params); err != nil {
		d.keyErr = err
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
		i.invalidKeys.Add(1)
		i.logger.Error("Message refused: invalid key", d.keyErr, watermill.LogFields{"message_uuid": safeUUID(msg.UUID)})
		return d
	}
	d.params.Key = Key{MessageID: key, ConsumerName: i.cfg.ConsumerName}
	d.res.Key = d.params.Key
	d.params.CorrelationID = validOrEmpty(wmmiddleware.MessageCorrelationID(msg))
	if i.cfg.MessageTypeKey != "-" {
		d.params.MessageType = validOrEmpty(msg.Metadata.Get(i.cfg.MessageTypeKey))
	}
	d.payloadHash = sha256.Sum256(msg.Payload) // held in d: no allocation of its own
	d.params.PayloadHash = d.payloadHash[:]
	if i.attempts != nil {
		d.countFirst = i.cfg.Redelivery == nil || i.cfg.Redelivery(msg) != FirstDelivery
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
func (i *Inbox) try(d *delivery, h message.HandlerFunc) (f *failure) {
	start := time.Now()
	phaseCtx, endClaim := i.startPhase(d.ctx, PhaseClaim)
	claimCtx, cancel := context.WithTimeout(phaseCtx, i.cfg.ClaimTimeout)
	var (
		tx        Tx
		counted   CountedTx
		claimed   bool
		storedSum []byte
		rec       AttemptRecord
		err       error
	)
	if i.attempts != nil {
		var res CountedClaimResult
		counted, res, err = i.attempts.ClaimCounted(claimCtx, CountedClaimParams{ClaimParams: d.params, CountFirst: d.countFirst && !d.counted, CountLimit: i.cfg.MaxAttempts, NoRecord: d.noRecord && !d.counted})
		if counted != nil {
			tx = counted
		}
		claimed, storedSum, rec = res.Claimed, res.StoredPayloadHash, res.Record
		if res.Counted {
			d.counted = true
		}
	} else {
		var res ClaimResult
		tx, res, err = i.cfg.Store.Claim(claimCtx, d.params)
		claimed, storedSum = res.Claimed, res.StoredPayloadHash
	}
	cancel()
	d.res.Claim = time.Since(start)
	endClaim(err)
	if err != nil {
		err = fmt.Errorf("inbox: claim: %w", err)
		i.configurationFault(err) // a missing privilege or table is logged at ERROR
		return &failure{kind: failInfrastructure, err: err}
	}
	switch {
	case rec.DeadLettered:
		d.res.Outcome = OutcomeDeadLetteredSkip
		return nil
	case !claimed:
		d.counted = false // the store took a duplicate's count back
		if len(storedSum) > 0 && !bytes.HasPrefix(d.params.PayloadHash, storedSum) {
			d.res.Outcome = OutcomeCollision
		} else {
			d.res.Outcome = OutcomeDuplicate
		}
		return nil
	}
	d.attempts = rec.Attempts
	// Deliveries before this one that ran the handler without settling (this one's own
	// count excluded).
	earlier := rec.Attempts - b2i(d.counted)
	if counted != nil && earlier >= i.cfg.MaxAttempts {
		n, err := counted.Fail(d.ctx, FailParams{AttemptsDelta: -b2i(d.counted)})
		// Fail took the count back even when it reports an error (after the rollback, best
		// effort): settleFailure must not take it back again.
		d.counted = false
		if err != nil {
			return &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: release the claim of an exhausted message: %w", err)}
		}
		d.attempts = n
		d.res.Reason = exhaustedReason(earlier, i.cfg.MaxAttempts, rec.LastError)
		return &failure{kind: failMessage, err: Permanent(errors.New(d.res.Reason)), attempts: n}
	}
	if counted != nil && i.suspect(d, earlier, rec) {
		// Earlier attempts ended unsettled (crashes): run again alone, so a crash is charged
		// to this message only if it happens while this message runs alone. Nothing of this
		// try is kept: its claim and its count are taken back.
		n, err := counted.Fail(d.ctx, FailParams{AttemptsDelta: -b2i(d.counted)})
		d.counted = false // taken back even when Fail reports an error (see above)
		if err != nil {
			return &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: release the claim to run alone: %w", err)}
		}
		d.attempts = n
		return &failure{kind: failIsolate}
	}

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
		goexit := p == nil
		switch {
		case counted != nil && goexit:
			d.attempts, _ = counted.Fail(d.ctx, FailParams{AttemptsDelta: -b2i(d.counted)})
		case counted != nil:
			n, err := counted.Fail(d.ctx, FailParams{AttemptsDelta: 1 - b2i(d.counted), Error: fmt.Sprintf("handler panicked: %v", p)})
			if err != nil {
				n = d.attempts + 1 - b2i(d.counted)
			}
			d.attempts = n
		default:
			_ = tx.Rollback(d.ctx)
		}
		d.counted = false
		if !goexit {
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
		herr = i.storeProduced(txCtx, tx, produced, d.msg)
	}
	d.res.Handler = time.Since(hstart)
	settled = true
	endH(herr)

	if herr != nil {
		return i.failTx(d, tx, counted, herr)
	}
	cstart := time.Now()
	_, endCommit := i.startPhase(d.ctx, PhaseCommit)
	err = tx.Commit(d.ctx)
	d.res.Commit = time.Since(cstart)
	endCommit(err)
	switch {
	case err == nil:
		d.counted = false // the commit cleared the attempt record
		d.res.Outcome = OutcomeProcessed
		return nil
	case i.cfg.Store.Retryable(err):
		if d.counted {
			// As in failTx: no count is kept through the back-off.
			i.adjust(d, -1, "")
			d.counted = false
		}
		return &failure{kind: failRetryable, err: fmt.Errorf("inbox: commit: %w", err)}
	case i.configurationFault(err):
		return &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: commit: %w", err)}
	case errors.Is(err, ErrCommitRolledBack):
		// Rolled back for certain: the transaction's own doing, so it is the message's
		// failure. The transaction is gone: record it outside.
		err = fmt.Errorf("inbox: commit: %w", err)
		f := &failure{kind: failMessage, err: err}
		if i.attempts != nil {
			f.attempts = i.adjust(d, 1-b2i(d.counted), err.Error())
			d.counted = false
		}
		return f
	}
	// The outcome is unknown: it may have committed. Nack, never dead-letter; the redelivery
	// is a duplicate if it did.
	return &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: commit (outcome unknown): %w", err)}
}

// failTx ends a transaction whose handler (or outbox write) returned herr.
func (i *Inbox) failTx(d *delivery, tx Tx, counted CountedTx, herr error) *failure {
	kind := failMessage
	switch {
	case i.cfg.Store.Retryable(herr):
		kind = failRetryable
	case i.configurationFault(herr), errors.Is(herr, ErrProducedMessages), errors.Is(herr, ErrNoPublishTopic):
		// The deployment's fault (a missing privilege or table, no Outbox, no publish
		// topic): no message can succeed until it is fixed.
		kind = failInfrastructure
	case errors.Is(d.ctx.Err(), context.Canceled):
		// The consumer is shutting down (the router cancels message contexts on Close):
		// not the message's failure.
		kind = failAbandoned
	}
	f := &failure{kind: kind, err: herr}
	if kind == failRetryable && counted != nil && d.counted {
		// A retryable failure takes the delivery's count back: kept through the back-off,
		// when this delivery holds no lock on the key, it would be read as a failure by a
		// copy that runs meanwhile. The next try counts first again.
		n, err := counted.Fail(d.ctx, FailParams{AttemptsDelta: -1})
		if err != nil {
			i.logger.Error("Could not take back the count of a conflicted try", err, watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
		}
		d.counted, d.attempts = false, n
		return f
	}
	if counted == nil || kind == failRetryable || kind == failInfrastructure {
		_ = tx.Rollback(d.ctx)
		return f
	}
	p := FailParams{AttemptsDelta: 1 - b2i(d.counted), Error: herr.Error()}
	if kind == failAbandoned {
		p = FailParams{AttemptsDelta: -b2i(d.counted)}
	}
	n, err := counted.Fail(d.ctx, p)
	if err != nil {
		i.logger.Error("Could not record the failed attempt", err, watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
		if d.noRecord && kind == failMessage {
			// A first delivery read no record, so it cannot tell what the record says now (the
			// key may even be dead-lettered): nack, and let the redelivery, counted first and
			// reading the record, decide. Never dead-letter on a guess.
			d.counted = false
			return &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: record the failed attempt: %w (handler error: %v)", err, herr)}
		}
		n = d.attempts + p.AttemptsDelta // what the record would say
	}
	d.counted, d.attempts, f.attempts = false, n, n
	if err == nil && p.AttemptsDelta > 0 && n == 0 {
		// Nothing was counted: the key is dead-lettered (or processed by another copy). Only
		// a first delivery, claimed without reading the record (NoRecord), gets here. Nack it
		// rather than dead-letter it a second time: its redelivery is counted first, reads the
		// record and is skipped.
		// %v, not %w: a permanent error must not reach an outer PoisonQueue as permanent.
		return &failure{kind: failInfrastructure, err: fmt.Errorf("inbox: the message is already dead-lettered or processed; nacked so that its redelivery is skipped (handler error: %v)", herr)}
	}
	return f
}

// configurationFault reports whether the store classifies err as the deployment's fault
// (inbox.FaultClassifier), and logs it at ERROR when so.
func (i *Inbox) configurationFault(err error) bool {
	fc, ok := i.cfg.Store.(FaultClassifier)
	if !ok || !fc.ConfigurationFault(err) {
		return false
	}
	i.logger.Error("Configuration fault: the delivery is nacked without using up an attempt; no message can succeed until it is fixed", err, nil)
	return true
}

// adjust applies delta to the message's attempt record outside a transaction, and returns
// the count afterwards (best effort: on a store error it logs and returns d.attempts).
func (i *Inbox) adjust(d *delivery, delta int, errText string) int {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(d.ctx), i.cfg.FinishTimeout)
	defer cancel()
	n, err := i.attempts.AdjustAttempts(ctx, AttemptParams{Key: d.params.Key, AttemptsDelta: delta, Error: errText})
	if err != nil {
		i.logger.Error("Could not record the attempt", err, watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
		return d.attempts
	}
	d.attempts = n
	return n
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
	d.res.Err = f.err
	d.res.Attempts = d.attempts
	if f.kind != failMessage {
		// Not the message's failure: take back a count this delivery still holds.
		if d.counted {
			i.adjust(d, -1, "")
			d.counted = false
			d.res.Attempts = d.attempts
		}
		d.res.Outcome = OutcomeFailedRetryable
		if f.kind == failAbandoned {
			i.logger.Info(abandonedWhy(d.ctx), watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
		}
		return
	}
	permanent := IsPermanent(f.err)
	if i.attempts == nil {
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
	case i.cfg.OnKeyCollision == CollisionDeadLetter && i.attempts != nil:
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
func (i *Inbox) storeProduced(txCtx context.Context, tx Tx, produced []*message.Message, received *message.Message) error {
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
	if err := i.cfg.Outbox.Store(txCtx, tx, topic, produced); err != nil {
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

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// validOrEmpty drops optional metadata that PostgreSQL text cannot hold or that is unbounded.
func validOrEmpty(s string) string {
	if ValidateKey("", s) != nil {
		return ""
	}
	return s
}

// safeUUID returns the message UUID for logs and error strings: a placeholder when it is not
// key material (invalid UTF-8, NUL, oversized), quoted with Go escapes when it holds a control
// character (a newline or an escape sequence could forge log lines), else as it is.
func safeUUID(id string) string {
	if ValidateKey("", id) != nil {
		return fmt.Sprintf("<invalid, %d bytes>", len(id))
	}
	if strings.IndexFunc(id, unicode.IsControl) >= 0 {
		return strconv.Quote(id)
	}
	return id
}
