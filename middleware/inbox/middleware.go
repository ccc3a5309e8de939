package inbox

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
)

// Defaults applied by Config.setDefaults.
const (
	// DefaultMessageTypeKey is the metadata field read for message_type: the key Watermill's
	// CQRS marshalers write the event or command name to.
	DefaultMessageTypeKey = "name"
	// DefaultFinishTimeout bounds COMMIT and ROLLBACK, which run detached from the message's
	// context (the router cancels that context on shutdown).
	DefaultFinishTimeout = 10 * time.Second
	// DefaultClaimTimeout bounds the claim (see Config.ClaimTimeout).
	DefaultClaimTimeout = 30 * time.Second
	// DefaultMaxTxRetries is how many times a transaction that failed with a transient conflict
	// (SQLSTATE 40001 or 40P01) is retried in process before the delivery is nacked.
	DefaultMaxTxRetries = 3
	// DefaultTxRetryBackoff is the first pause before such a retry; it doubles per retry, with
	// jitter, up to DefaultMaxTxRetryBackoff.
	DefaultTxRetryBackoff = 10 * time.Millisecond
	// DefaultMaxTxRetryBackoff caps the pause between transaction retries.
	DefaultMaxTxRetryBackoff = 500 * time.Millisecond
	// DefaultMaxAttempts is how many deliveries of one message may run the handler before the
	// message is dead-lettered, when a dead-letter topic is configured.
	DefaultMaxAttempts = 5
)

// Metadata keys the inbox adds to a dead letter, beside Watermill's PoisonQueue keys
// (reason_poisoned, topic_poisoned, handler_poisoned, subscriber_poisoned), which it sets too
// so existing poison-queue tooling reads inbox dead letters.
const (
	// DeadLetterAttemptsKey holds the number of attempts counted for the message (decimal).
	DeadLetterAttemptsKey = "inbox_attempts"
	// DeadLetterConsumerKey holds the consumer name.
	DeadLetterConsumerKey = "inbox_consumer_name"
	// DeadLetterMessageKeyKey holds the message key (empty when the key was invalid).
	DeadLetterMessageKeyKey = "inbox_message_key"
)

// CollisionPolicy decides what happens to a key collision: a delivery whose key was already
// processed with a different payload hash (see ErrKeyCollision).
type CollisionPolicy int

const (
	// CollisionDeadLetter publishes the colliding message to the dead-letter topic with the
	// reason and acks it; without a dead-letter topic it behaves as CollisionReject. Default.
	CollisionDeadLetter CollisionPolicy = iota
	// CollisionReject returns ErrKeyCollision, so the router nacks.
	CollisionReject
	// CollisionSkip acks the colliding message without running the handler, like a duplicate,
	// and counts it in Stats.Collisions. Choose it only when payloads of one logical message
	// may legitimately differ (a timestamp re-stamped on every producer retry).
	CollisionSkip
)

// Config configures an Inbox. Zero values take the defaults documented on each field.
type Config struct {
	// Store opens transactions and claims messages (required), e.g. pgstore.New(pool, ...).
	Store Store
	// ConsumerName identifies the handler (required, at most MaxConsumerNameBytes bytes of
	// UTF-8). It is half of the inbox key, so several handlers consuming the same message each
	// process it once and never block each other. Keep it stable across deploys: renaming a
	// consumer makes every retained message look new to it.
	ConsumerName string
	// KeyExtractor returns each message's key. Default: MessageUUID().
	KeyExtractor KeyExtractor
	// Isolation is the level of the claim-and-handler transaction. Default: READ COMMITTED.
	// Under REPEATABLE READ and SERIALIZABLE, conflicts end in SQLSTATE 40001, which the inbox
	// retries (see MaxTxRetries).
	Isolation sql.IsolationLevel
	// MessageTypeKey is the metadata field stored in message_type. Default:
	// DefaultMessageTypeKey. Set it to "-" to store no message type.
	MessageTypeKey string
	// FinishTimeout bounds COMMIT and ROLLBACK. Default: DefaultFinishTimeout.
	FinishTimeout time.Duration
	// ClaimTimeout bounds everything before the handler runs (taking a connection, counting
	// the attempt, BEGIN and the claim), whatever the network does: past it the delivery
	// fails and is nacked. It also bounds a concurrent duplicate's wait behind a slow
	// handler's uncommitted claim. Default: DefaultClaimTimeout.
	ClaimTimeout time.Duration
	// MaxTxRetries is the number of in-process retries of a whole transaction (claim, handler,
	// commit) after a transient conflict the Store reports as Retryable (PostgreSQL SQLSTATE
	// 40001 serialization_failure, 40P01 deadlock_detected). Default: DefaultMaxTxRetries.
	// Set it to -1 for no retries. After the last retry the delivery is nacked.
	MaxTxRetries int
	// TxRetryBackoff is the first pause before a retry. Default: DefaultTxRetryBackoff.
	TxRetryBackoff time.Duration
	// MaxTxRetryBackoff caps the pause between retries. Default: DefaultMaxTxRetryBackoff.
	MaxTxRetryBackoff time.Duration

	// DeadLetterPublisher and DeadLetterTopic, set together, turn on durable attempt counting
	// and dead letters: every delivery is counted in the store before its transaction begins,
	// and a message is published to DeadLetterTopic, then acked, when its handler failed
	// MaxAttempts times (crashes included), or returned a permanent error (see IsPermanent),
	// or its key is invalid, or its key collides. If the publish fails the delivery is nacked:
	// it is never acked without its dead letter. A dead-lettered message's later deliveries
	// are acked without running the handler, until Replay.
	DeadLetterPublisher message.Publisher
	// DeadLetterTopic is the topic dead letters are published to.
	DeadLetterTopic string
	// MaxAttempts is the number of deliveries that may run the handler before the message is
	// dead-lettered. Default: DefaultMaxAttempts. Used only with a dead-letter topic.
	MaxAttempts int
	// OnKeyCollision decides what a key collision does. Default: CollisionDeadLetter.
	OnKeyCollision CollisionPolicy

	// LockTimeout bounds every lock wait in the inbox transaction, including the wait of a
	// concurrent duplicate behind a slow handler's uncommitted claim (PostgreSQL lock_timeout).
	// An expired wait fails the delivery (SQLSTATE 55P03) and the router nacks; the redelivery
	// resolves as a duplicate once the first commits. Zero keeps the server's setting.
	LockTimeout time.Duration
	// StatementTimeout bounds every statement in the inbox transaction (PostgreSQL
	// statement_timeout; SQLSTATE 57014). Zero keeps the server's setting.
	StatementTimeout time.Duration

	// BrokerSideFields names the metadata fields the subscriber's broker adds to describe a
	// delivery (field name to reason; each adapter exports its map, e.g.
	// adapters/amqp.BrokerSideFields). They are removed from dead letters, beside the
	// built-in list, so a replayed message does not carry the old delivery's state.
	BrokerSideFields map[string]string

	// Outbox, when set, receives the messages a handler returns (with router.AddHandler),
	// inside the inbox transaction, for the handler's publish topic; the router then has
	// nothing left to publish. A crash after the commit loses none of them, and a duplicate
	// delivery produces none again. Without it, returned messages fail the delivery with
	// ErrProducedMessages.
	Outbox Outbox
}

func (c *Config) setDefaults() {
	if c.KeyExtractor == nil {
		c.KeyExtractor = MessageUUID()
	}
	if c.Isolation == sql.LevelDefault {
		c.Isolation = sql.LevelReadCommitted
	}
	if c.MessageTypeKey == "" {
		c.MessageTypeKey = DefaultMessageTypeKey
	}
	if c.FinishTimeout == 0 {
		c.FinishTimeout = DefaultFinishTimeout
	}
	if c.ClaimTimeout == 0 {
		c.ClaimTimeout = DefaultClaimTimeout
	}
	if c.MaxTxRetries == 0 {
		c.MaxTxRetries = DefaultMaxTxRetries
	} else if c.MaxTxRetries < 0 {
		c.MaxTxRetries = 0
	}
	if c.TxRetryBackoff == 0 {
		c.TxRetryBackoff = DefaultTxRetryBackoff
	}
	if c.MaxTxRetryBackoff == 0 {
		c.MaxTxRetryBackoff = DefaultMaxTxRetryBackoff
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
}

// Validate returns an error wrapping ErrInvalidConfig for a missing Store, an invalid
// ConsumerName, a negative duration, an unsupported isolation level, a dead-letter publisher
// without a topic (or the reverse), MaxAttempts below 1 or an unknown collision policy. New calls it after
// filling defaults.
func (c Config) Validate() error {
	if c.Store == nil {
		return fmt.Errorf("%w: Store is required", ErrInvalidConfig)
	}
	if err := validateConsumerName(c.ConsumerName); err != nil {
		return err
	}
	switch c.Isolation {
	case sql.LevelDefault, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable:
	default:
		return fmt.Errorf("%w: isolation level %s is not supported (use READ COMMITTED, REPEATABLE READ or SERIALIZABLE)", ErrInvalidConfig, c.Isolation)
	}
	if c.FinishTimeout < 0 || c.ClaimTimeout < 0 || c.TxRetryBackoff < 0 || c.MaxTxRetryBackoff < 0 || c.LockTimeout < 0 || c.StatementTimeout < 0 {
		return fmt.Errorf("%w: durations must not be negative", ErrInvalidConfig)
	}
	if (c.DeadLetterPublisher == nil) != (c.DeadLetterTopic == "") {
		return fmt.Errorf("%w: DeadLetterPublisher and DeadLetterTopic must be set together", ErrInvalidConfig)
	}
	if c.MaxAttempts < 1 {
		return fmt.Errorf("%w: MaxAttempts must be at least 1", ErrInvalidConfig)
	}
	if c.OnKeyCollision < CollisionDeadLetter || c.OnKeyCollision > CollisionSkip {
		return fmt.Errorf("%w: unknown OnKeyCollision policy %d", ErrInvalidConfig, c.OnKeyCollision)
	}
	return nil
}

// Stats are counters since the Inbox was created. Each field counts deliveries, except
// TxRetries, which counts transaction attempts.
type Stats struct {
	// Processed counts deliveries whose handler ran and whose transaction committed.
	Processed uint64
	// Duplicates counts deliveries skipped because their key was already claimed.
	Duplicates uint64
	// Failed counts deliveries that returned an error (and were nacked by the router).
	Failed uint64
	// InvalidKeys counts deliveries refused for an invalid key (a subset of Failed).
	InvalidKeys uint64
	// TxRetries counts in-process transaction retries after a Retryable conflict.
	TxRetries uint64
	// DeadLettered counts messages published to the dead-letter topic (then acked).
	DeadLettered uint64
	// DeadLetteredSkips counts deliveries of already dead-lettered messages, acked without
	// running the handler. They are not counted as Processed.
	DeadLetteredSkips uint64
	// Collisions counts key collisions (same key, different payload), whatever the policy.
	Collisions uint64
}

// Inbox is the transactional inbox middleware for one consumer. It is safe for concurrent use
// by any number of deliveries; each holds one store connection while it runs.
type Inbox struct {
	cfg    Config
	logger watermill.LoggerAdapter

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
	return &Inbox{cfg: cfg, logger: logger.With(watermill.LogFields{"consumer_name": cfg.ConsumerName})}, nil
}

// Stats returns a snapshot of the counters.
func (i *Inbox) Stats() Stats {
	return Stats{
		Processed:   i.processed.Load(),
		Duplicates:  i.duplicates.Load(),
		Failed:      i.failed.Load(),
		InvalidKeys: i.invalidKeys.Load(),
		TxRetries:   i.txRetries.Load(),

		DeadLettered:      i.deadLettered.Load(),
		DeadLetteredSkips: i.deadLetteredSkips.Load(),
		Collisions:        i.collisions.Load(),
	}
}

// ConsumerName returns the configured consumer name.
func (i *Inbox) ConsumerName() string { return i.cfg.ConsumerName }

// Middleware wraps h as an idempotent consumer. Per delivery it: extracts and validates the
// key; opens a transaction and claims (message_id, consumer_name) in it, insert-first; runs h
// with the transaction reachable from msg.Context() (pgstore.TxFromContext); commits; and only
// then returns nil, so the router acks after the commit.
//
//   - Key already claimed (a duplicate): h does not run, nil is returned and the router acks.
//     A duplicate whose payload differs is a key collision, handled by OnKeyCollision.
//   - h returns an error or panics: the transaction rolls back (no claim remains), the error is
//     returned (the panic propagates) and the router nacks; the redelivery runs h again.
//   - h returns messages: rolled back, ErrProducedMessages returned (see its doc).
//   - Commit fails, including pgx.ErrTxCommitRollback (h swallowed a failed statement) and a
//     commit whose outcome is unknown: the error is returned and the router nacks; if it had
//     in fact committed, the redelivery is a duplicate.
//   - A Retryable conflict (40001, 40P01) anywhere in the transaction: the whole transaction is
//     retried with a fresh claim up to MaxTxRetries times, then the error is returned.
//   - Invalid key: an *InvalidKeyError (IsPermanent reports true); nothing is claimed and h
//     does not run.
//
// With a dead-letter topic (Config.DeadLetterPublisher), deliveries are counted durably and
// a message is dead-lettered and acked after MaxAttempts failed attempts or on a permanent
// error; see Config.DeadLetterPublisher.
//
// Middleware has the type of Watermill's message.HandlerMiddleware. Add it innermost (last),
// after Retry, PoisonQueue, Timeout and CorrelationID; see docs/design.md for the order.
func (i *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		select {
		case <-msg.Acked():
			return nil, i.fail(msg, Claim{}, 0, ErrAckedBeforeHandler)
		default:
		}
		claim, err := i.claimFor(msg)
		if err != nil {
			i.invalidKeys.Add(1)
			i.logger.Error("Message refused: invalid key", err, watermill.LogFields{"message_uuid": safeUUID(msg.UUID)})
			return nil, i.fail(msg, Claim{}, 0, err)
		}
		backoff := i.cfg.TxRetryBackoff
		countAttempt := i.deadLettering()
		for retry := 0; ; retry++ {
			r := i.attempt(msg, h, claim, countAttempt)
			if r.err == nil {
				return nil, nil
			}
			if r.final {
				i.failed.Add(1)
				return nil, r.err
			}
			if countAttempt && r.attempt > 0 {
				// Only the delivery's first transaction counts as an attempt; in-process
				// retries after a transient conflict are part of it.
				countAttempt = false
			}
			if retry >= i.cfg.MaxTxRetries || !i.cfg.Store.Retryable(r.err) {
				return nil, i.fail(msg, claim, r.attempt, r.err)
			}
			i.txRetries.Add(1)
			i.logger.Debug("Transient conflict, retrying the transaction", watermill.LogFields{
				"message_uuid": safeUUID(msg.UUID), "retry": retry + 1, "error": r.err.Error(),
			})
			pause := backoff/2 + rand.N(backoff/2+1)
			select {
			case <-time.After(pause):
			case <-msg.Context().Done():
				return nil, i.fail(msg, claim, r.attempt, errors.Join(r.err, msg.Context().Err()))
			}
			backoff = min(backoff*2, i.cfg.MaxTxRetryBackoff)
		}
	}
}

// deadLettering reports whether a dead-letter topic is configured.
func (i *Inbox) deadLettering() bool { return i.cfg.DeadLetterPublisher != nil }

// fail decides what a failed delivery becomes: a dead letter (then nil, so the router acks) or
// the error (the router nacks). attempt is the delivery's counted attempt (0 when not counted).
func (i *Inbox) fail(msg *message.Message, claim Claim, attempt int, err error) error {
	if err := i.settleFailure(msg, claim, attempt, err); err != nil {
		i.failed.Add(1)
		return err
	}
	return nil
}

func (i *Inbox) settleFailure(msg *message.Message, claim Claim, attempt int, err error) error {
	if !i.deadLettering() {
		return err
	}
	keyed := claim.MessageID != ""
	switch {
	case IsPermanent(err):
		return i.deadLetter(msg, claim, attempt, "permanent error: "+err.Error(), keyed)
	case keyed && attempt >= i.cfg.MaxAttempts:
		i.recordFailure(msg, claim, err)
		return i.deadLetter(msg, claim, attempt, fmt.Sprintf("failed %d of %d attempts; last error: %s", attempt, i.cfg.MaxAttempts, err), true)
	}
	if keyed && attempt > 0 {
		i.recordFailure(msg, claim, err)
	}
	return err
}

func (i *Inbox) recordFailure(msg *message.Message, claim Claim, cause error) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(msg.Context()), i.cfg.FinishTimeout)
	defer cancel()
	if err := i.cfg.Store.RecordFailure(ctx, claim.MessageID, claim.ConsumerName, cause.Error()); err != nil {
		i.logger.Error("Could not record the failed attempt", err, watermill.LogFields{"message_uuid": safeUUID(msg.UUID)})
	}
}

// deadLetter publishes a copy of msg to the dead-letter topic with the reason, records the
// dead-lettered state when mark is set, and returns nil (ack). When the publish fails it
// returns the error (nack): a message is never acked without its dead letter.
func (i *Inbox) deadLetter(msg *message.Message, claim Claim, attempt int, reason string, mark bool) error {
	ctx := msg.Context()
	dl := msg.Copy()
	for k := range dl.Metadata {
		// Delivery-specific fields (a redelivered flag, a delivery count) would describe the
		// original delivery, and make a replayed message look redelivered.
		if IsBrokerSideField(k, i.cfg.BrokerSideFields) {
			delete(dl.Metadata, k)
		}
	}
	dl.Metadata.Set(wmmiddleware.ReasonForPoisonedKey, reason)
	dl.Metadata.Set(wmmiddleware.PoisonedTopicKey, message.SubscribeTopicFromCtx(ctx))
	dl.Metadata.Set(wmmiddleware.PoisonedHandlerKey, message.HandlerNameFromCtx(ctx))
	dl.Metadata.Set(wmmiddleware.PoisonedSubscriberKey, message.SubscriberNameFromCtx(ctx))
	dl.Metadata.Set(DeadLetterAttemptsKey, strconv.Itoa(attempt))
	dl.Metadata.Set(DeadLetterConsumerKey, i.cfg.ConsumerName)
	dl.Metadata.Set(DeadLetterMessageKeyKey, claim.MessageID)
	fields := watermill.LogFields{"message_uuid": safeUUID(msg.UUID), "attempts": attempt, "dead_letter_topic": i.cfg.DeadLetterTopic}
	if err := i.cfg.DeadLetterPublisher.Publish(i.cfg.DeadLetterTopic, dl); err != nil {
		i.logger.Error("Could not publish the dead letter; nacking", err, fields)
		return fmt.Errorf("inbox: publishing dead letter: %w", err)
	}
	if mark {
		mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), i.cfg.FinishTimeout)
		defer cancel()
		if err := i.cfg.Store.MarkDeadLettered(mctx, claim.MessageID, claim.ConsumerName, reason); err != nil {
			// The dead letter is out, so ack anyway: the attempt count stays above the limit,
			// so a later delivery is dead-lettered again rather than processed.
			i.logger.Error("Dead letter published but its state not recorded", err, fields)
		}
	}
	i.deadLettered.Add(1)
	i.logger.Info("Message dead-lettered", fields.Add(watermill.LogFields{"reason": reason}))
	return nil
}

// Replay clears the dead-lettered state and attempt count of messageID for this consumer, so
// its next delivery runs the handler again (republish it from the dead-letter topic to the
// handler's topic). It reports whether the message was dead-lettered.
func (i *Inbox) Replay(ctx context.Context, messageID string) (bool, error) {
	if err := ValidateKey("message ID", messageID); err != nil {
		return false, err
	}
	return i.cfg.Store.Replay(ctx, messageID, i.cfg.ConsumerName)
}

// claimFor builds the claim of msg, or returns an *InvalidKeyError.
func (i *Inbox) claimFor(msg *message.Message) (Claim, error) {
	source := i.cfg.KeyExtractor.Source()
	key, err := i.cfg.KeyExtractor.ExtractKey(msg)
	if err != nil {
		return Claim{}, Permanent(fmt.Errorf("inbox: extracting key from %s: %w", source, err))
	}
	if err := ValidateKey(source, key); err != nil {
		return Claim{}, err
	}
	c := Claim{
		MessageID:     key,
		ConsumerName:  i.cfg.ConsumerName,
		CorrelationID: validOrEmpty(wmmiddleware.MessageCorrelationID(msg)),
	}
	if i.cfg.MessageTypeKey != "-" {
		c.MessageType = validOrEmpty(msg.Metadata.Get(i.cfg.MessageTypeKey))
	}
	sum := sha256.Sum256(msg.Payload)
	c.PayloadHash = sum[:]
	return c, nil
}

// attemptResult is the outcome of one transaction.
type attemptResult struct {
	err     error
	attempt int // the counted attempt number, 0 when not counted
	// final marks an error that was already settled (a dead letter that could not be
	// published, a rejected collision): it goes back to the router as it is.
	final bool
}

// attempt runs one transaction: claim, handler, commit. Its error is nil when the message was
// processed, is a duplicate, was dead-lettered before, or was dead-lettered now.
func (i *Inbox) attempt(msg *message.Message, h message.HandlerFunc, claim Claim, countAttempt bool) (r attemptResult) {
	ctx := msg.Context()
	opts := TxOptions{
		Isolation: i.cfg.Isolation, CountAttempt: countAttempt,
		LockTimeout: i.cfg.LockTimeout, StatementTimeout: i.cfg.StatementTimeout,
	}
	claimCtx, cancelClaim := context.WithTimeout(ctx, i.cfg.ClaimTimeout)
	tx, res, err := i.cfg.Store.BeginClaim(claimCtx, opts, claim)
	cancelClaim()
	if err != nil {
		return attemptResult{err: fmt.Errorf("inbox: claim: %w", err)}
	}
	r.attempt = res.Attempt
	finished := false
	defer func() {
		if !finished {
			// Reached on a handler panic, which keeps propagating after the rollback.
			msg.SetContext(ctx)
			i.finish(ctx, tx.Rollback)
			i.failed.Add(1)
		}
	}()

	// Built only when something is logged: not on the path of a processed message.
	fields := func() watermill.LogFields {
		return watermill.LogFields{"message_uuid": safeUUID(msg.UUID), "attempt": res.Attempt}
	}
	switch {
	case res.DeadLettered:
		finished = true
		i.finish(ctx, tx.Rollback)
		i.deadLetteredSkips.Add(1)
		i.logger.Info("Dead-lettered message delivered again; skipped", fields())
		return r
	case !res.Claimed:
		// Commit rather than roll back: the transaction deleted the attempt record this
		// delivery created. The claim itself is certain, so a failed commit changes nothing.
		finished = true
		if err := i.finish(ctx, tx.Commit); err != nil {
			i.logger.Debug("Commit of a duplicate's transaction failed", fields().Add(watermill.LogFields{"error": err.Error()}))
		}
		if len(res.StoredPayloadHash) > 0 && !bytes.Equal(res.StoredPayloadHash, claim.PayloadHash) {
			return i.collision(msg, claim, r)
		}
		i.duplicates.Add(1)
		i.logger.Debug("Duplicate message skipped", fields())
		return r
	case countAttempt && res.Attempt > i.cfg.MaxAttempts:
		// Earlier attempts crashed before they could dead-letter the message.
		finished = true
		i.finish(ctx, tx.Rollback)
		r.err = i.deadLetter(msg, claim, res.Attempt, fmt.Sprintf("exceeded %d attempts (earlier deliveries ended unsettled: the consumer crashed, or the dead letter could not be published)", i.cfg.MaxAttempts), true)
		r.final = true
		return r
	}

	txCtx := tx.Context(ctx)
	msg.SetContext(txCtx)
	produced, herr := h(msg)
	msg.SetContext(ctx)

	if herr == nil && len(produced) > 0 {
		herr = i.storeProduced(txCtx, produced)
	}
	if herr != nil {
		finished = true
		i.finish(ctx, tx.Rollback)
		r.err = herr
		return r
	}

	finished = true
	if err := i.finish(ctx, tx.Commit); err != nil {
		r.err = fmt.Errorf("inbox: commit: %w", err)
		if !errors.Is(err, ErrCommitRolledBack) && !i.cfg.Store.Retryable(err) {
			// The outcome is unknown: it may have committed. Nack, never dead-letter; the
			// redelivery is a duplicate if it did.
			r.final = true
		}
		return r
	}
	i.processed.Add(1)
	return r
}

// storeProduced writes a handler's output to the outbox in the inbox transaction.
func (i *Inbox) storeProduced(txCtx context.Context, produced []*message.Message) error {
	if i.cfg.Outbox == nil {
		return ErrProducedMessages
	}
	topic := message.PublishTopicFromCtx(txCtx)
	if topic == "" {
		return ErrNoPublishTopic
	}
	if err := i.cfg.Outbox.Store(txCtx, topic, produced); err != nil {
		return fmt.Errorf("inbox: storing %d produced messages in the outbox: %w", len(produced), err)
	}
	return nil
}

// collision applies OnKeyCollision to a duplicate whose payload hash differs.
func (i *Inbox) collision(msg *message.Message, claim Claim, r attemptResult) attemptResult {
	i.collisions.Add(1)
	i.logger.Error("Key collision: key already processed with a different payload", ErrKeyCollision,
		watermill.LogFields{"message_uuid": safeUUID(msg.UUID), "policy": i.cfg.OnKeyCollision})
	switch {
	case i.cfg.OnKeyCollision == CollisionSkip:
		return r
	case i.cfg.OnKeyCollision == CollisionDeadLetter && i.deadLettering():
		// Not marked as dead-lettered: the key belongs to the message that was processed.
		r.err = i.deadLetter(msg, claim, r.attempt, ErrKeyCollision.Error(), false)
	default:
		r.err = ErrKeyCollision
	}
	r.final = true
	return r
}

// finish runs COMMIT or ROLLBACK on a context detached from the message's cancellation (it
// keeps its values), bounded by FinishTimeout.
func (i *Inbox) finish(msgCtx context.Context, f func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(msgCtx), i.cfg.FinishTimeout)
	defer cancel()
	return f(ctx)
}

// validOrEmpty drops optional metadata that PostgreSQL text cannot hold or that is unbounded.
func validOrEmpty(s string) string {
	if ValidateKey("", s) != nil {
		return ""
	}
	return s
}

// safeUUID returns the message UUID for logs, or a placeholder when it is not printable key
// material (invalid UTF-8, NUL, oversized).
func safeUUID(id string) string {
	if ValidateKey("", id) != nil {
		return fmt.Sprintf("<invalid, %d bytes>", len(id))
	}
	return id
}
