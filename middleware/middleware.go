package middleware

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
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
	// DefaultMaxTxRetries is how many times a transaction that failed with a transient conflict
	// (SQLSTATE 40001 or 40P01) is retried in process before the delivery is nacked.
	DefaultMaxTxRetries = 3
	// DefaultTxRetryBackoff is the first pause before such a retry; it doubles per retry, with
	// jitter, up to DefaultMaxTxRetryBackoff.
	DefaultTxRetryBackoff = 10 * time.Millisecond
	// DefaultMaxTxRetryBackoff caps the pause between transaction retries.
	DefaultMaxTxRetryBackoff = 500 * time.Millisecond
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
	// MaxTxRetries is the number of in-process retries of a whole transaction (claim, handler,
	// commit) after a transient conflict the Store reports as Retryable (PostgreSQL SQLSTATE
	// 40001 serialization_failure, 40P01 deadlock_detected). Default: DefaultMaxTxRetries.
	// Set it to -1 for no retries. After the last retry the delivery is nacked.
	MaxTxRetries int
	// TxRetryBackoff is the first pause before a retry. Default: DefaultTxRetryBackoff.
	TxRetryBackoff time.Duration
	// MaxTxRetryBackoff caps the pause between retries. Default: DefaultMaxTxRetryBackoff.
	MaxTxRetryBackoff time.Duration
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
}

// Validate returns an error wrapping ErrInvalidConfig for a missing Store, an invalid
// ConsumerName, a negative duration or an unsupported isolation level. New calls it after
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
	if c.FinishTimeout < 0 || c.TxRetryBackoff < 0 || c.MaxTxRetryBackoff < 0 {
		return fmt.Errorf("%w: durations must not be negative", ErrInvalidConfig)
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
}

// Inbox is the transactional inbox middleware for one consumer. It is safe for concurrent use
// by any number of deliveries; each holds one store connection while it runs.
type Inbox struct {
	cfg    Config
	logger watermill.LoggerAdapter

	processed, duplicates, failed, invalidKeys, txRetries atomic.Uint64
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
	}
}

// ConsumerName returns the configured consumer name.
func (i *Inbox) ConsumerName() string { return i.cfg.ConsumerName }

// Middleware wraps h as an idempotent consumer. Per delivery it: extracts and validates the
// key; opens a transaction and claims (message_id, consumer_name) in it, insert-first; runs h
// with the transaction reachable from msg.Context() (pgstore.TxFromContext); commits; and only
// then returns nil, so the router acks after the commit.
//
//   - Key already claimed (a duplicate): h does not run, the transaction rolls back, nil is
//     returned and the router acks.
//   - h returns an error or panics: the transaction rolls back (no claim remains), the error is
//     returned (the panic propagates) and the router nacks; the redelivery runs h again.
//   - h returns messages: rolled back, ErrProducedMessages returned (see its doc).
//   - Commit fails, including pgx.ErrTxCommitRollback (h swallowed a failed statement) and a
//     commit whose outcome is unknown: the error is returned and the router nacks; if it had
//     in fact committed, the redelivery is a duplicate.
//   - A Retryable conflict (40001, 40P01) anywhere in the transaction: the whole transaction is
//     retried with a fresh claim up to MaxTxRetries times, then the error is returned.
//   - Invalid key: an *InvalidKeyError is returned (IsPermanent reports true); nothing is
//     written and h does not run.
//
// Middleware has the type of Watermill's message.HandlerMiddleware. Add it innermost (last),
// after Retry, PoisonQueue, Timeout and CorrelationID; see docs/design.md for the order.
func (i *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		claim, err := i.claimFor(msg)
		if err != nil {
			i.failed.Add(1)
			i.invalidKeys.Add(1)
			i.logger.Error("Message refused: invalid key", err, watermill.LogFields{"message_uuid": safeUUID(msg.UUID)})
			return nil, err
		}
		backoff := i.cfg.TxRetryBackoff
		for attempt := 0; ; attempt++ {
			err = i.attempt(msg, h, claim)
			if err == nil {
				return nil, nil
			}
			if attempt >= i.cfg.MaxTxRetries || !i.cfg.Store.Retryable(err) {
				i.failed.Add(1)
				return nil, err
			}
			i.txRetries.Add(1)
			i.logger.Debug("Transient conflict, retrying the transaction", watermill.LogFields{
				"message_uuid": safeUUID(msg.UUID), "attempt": attempt + 1, "error": err.Error(),
			})
			pause := backoff/2 + rand.N(backoff/2+1)
			select {
			case <-time.After(pause):
			case <-msg.Context().Done():
				i.failed.Add(1)
				return nil, errors.Join(err, msg.Context().Err())
			}
			backoff = min(backoff*2, i.cfg.MaxTxRetryBackoff)
		}
	}
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

// attempt runs one transaction: claim, handler, commit. It returns nil when the message was
// processed or is a duplicate.
func (i *Inbox) attempt(msg *message.Message, h message.HandlerFunc, claim Claim) (err error) {
	ctx := msg.Context()
	tx, claimed, err := i.cfg.Store.BeginClaim(ctx, TxOptions{Isolation: i.cfg.Isolation}, claim)
	if err != nil {
		return fmt.Errorf("inbox: claim: %w", err)
	}
	finished := false
	defer func() {
		if !finished {
			// Reached on a handler panic, which keeps propagating after the rollback.
			msg.SetContext(ctx)
			i.finish(ctx, tx.Rollback)
		}
	}()

	if !claimed {
		finished = true
		i.finish(ctx, tx.Rollback)
		i.duplicates.Add(1)
		i.logger.Debug("Duplicate message skipped", watermill.LogFields{"message_uuid": safeUUID(msg.UUID)})
		return nil
	}

	msg.SetContext(tx.Context(ctx))
	produced, herr := h(msg)
	msg.SetContext(ctx)

	if herr == nil && len(produced) > 0 {
		herr = ErrProducedMessages
	}
	if herr != nil {
		finished = true
		i.finish(ctx, tx.Rollback)
		return herr
	}

	finished = true
	if err := i.finish(ctx, tx.Commit); err != nil {
		return fmt.Errorf("inbox: commit: %w", err)
	}
	i.processed.Add(1)
	return nil
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
