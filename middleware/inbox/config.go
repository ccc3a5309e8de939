package inbox

import (
	"database/sql"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Defaults that New applies to zero Config fields.
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
	// DeadLetterReplayedKey is the metadata field ReplayDeadLetter sets on the message it
	// republishes. The TooOldGuard lets a message carrying it through: an operator who
	// replays a dead letter has decided it must run.
	DeadLetterReplayedKey = "inbox_replayed"
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
	// Store opens transactions and claims messages, e.g. pgstore.New(pool, ...). Required,
	// unless Stores is set instead.
	Store Store
	// Stores, with Route, lets one consumer claim on several databases (a database per
	// tenant or per shard): route name (a tenant or shard name) to the store of its database,
	// each migrated there. Several names may share a store. Route picks each message's
	// store; its claim, its handler (pgstore.TxFromContext is that database's transaction),
	// its commit, its attempts and its dead-lettered state all live on that database, and a
	// batch (Batch) never spans two stores. A database that is down fails only the
	// deliveries routed to it. A message Route cannot place is refused with a *RouteError
	// (permanent: dead-lettered with a dead-letter topic, never claimed anywhere). Set Store
	// or Stores, not both. See docs/scaling.md, "A database per tenant or per shard".
	//
	// A message ID is deduplicated per database: every copy of a message must carry the
	// same route, or the copy routed elsewhere is processed a second time; and routes that
	// share a store share its keys.
	Stores map[string]Store
	// Route returns each message's route, a key of Stores (required with Stores, refused
	// without): RouteFromMetadata("tenant"), or a function of the message's own fields.
	Route RouteFunc
	// ConsumerName identifies the handler (required, at most MaxConsumerNameBytes bytes of
	// UTF-8, no NUL and no control characters: see docs/security.md). It is half of the inbox key, so several handlers consuming the same message each
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
	// handler's uncommitted claim. With a dead-letter topic it also bounds each wait at the
	// crash-isolation gate (docs/design.md, "Crash isolation"): a suspect's wait to run alone
	// and another delivery's wait behind it; past it, the delivery runs alongside the others
	// rather than fail. Default: DefaultClaimTimeout.
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
	// and dead letters: a message is published to
	// DeadLetterTopic, then acked, when its handler failed MaxAttempts times (crashes
	// included, see docs/design.md "Attempt accounting" for what counts), or returned a
	// permanent error (see IsPermanent), or its key is invalid, or its key collides. If the
	// publish fails the delivery is nacked: it is never acked without its dead letter. A
	// dead-lettered message's later deliveries are acked without running the handler, until
	// Replay.
	DeadLetterPublisher message.Publisher
	// DeadLetterTopic is the topic dead letters are published to.
	DeadLetterTopic string
	// MaxAttempts is the number of deliveries that may run the handler and fail before the
	// message is dead-lettered. Default: DefaultMaxAttempts. Used only with a dead-letter
	// topic. A delivery whose broker says it is a first delivery (see Redelivery) is counted
	// only if it fails, so a message that crashes the consumer on its first delivery runs at
	// most MaxAttempts+1 times.
	MaxAttempts int
	// Redelivery reads the broker's redelivery signal of a delivery (each adapter exports
	// one: adapters.Broker.Redelivery). With a dead-letter topic, a delivery that may be a
	// redelivery (Redelivered, or RedeliveryUnknown) is counted durably before its handler
	// runs, so a consumer that crashes on it still uses up an attempt; a FirstDelivery is
	// counted only after a failure, which is cheaper. Default: nil, every delivery
	// RedeliveryUnknown.
	Redelivery RedeliveryFunc
	// InvalidKeyBrake nacks, instead of dead-lettering, invalid keys while most recent
	// deliveries had one (ErrInvalidKeyFlood): on by default; see InvalidKeyBrake.
	InvalidKeyBrake InvalidKeyBrake
	// OnKeyCollision decides what a key collision does. Default: CollisionDeadLetter.
	OnKeyCollision CollisionPolicy

	// BrokerSideFields names the metadata fields the subscriber's broker adds to describe a
	// delivery (field name to reason; each adapter exports its map, e.g.
	// adapters/amqp.BrokerSideFields). They are removed from dead letters, beside the
	// built-in list, so a replayed message does not carry the old delivery's state.
	BrokerSideFields map[string]string

	// Outbox, when set, receives the messages a handler returns (a handler added with Watermill's AddHandler or
	// package router's AddPublishingConsumer),
	// inside the inbox transaction, for the handler's publish topic; the router then has
	// nothing left to publish. A crash after the commit loses none of them, and a duplicate
	// delivery produces none again. Without it, returned messages fail the delivery with
	// ErrProducedMessages.
	Outbox Outbox

	// ProducerTime, when set, reads when the producer created each message; the claim carries
	// it so a store partitioned by producer time files every copy of a message in the same
	// partition; New refuses such a store without it. A message it cannot read a time from
	// is refused as an invalid key.
	ProducerTime ProducerTimeFunc

	// Observer, when set, is told how every delivery ended (see Result): the hook for
	// metrics and tracing. It runs on the delivery's goroutine after the outcome is settled
	// and before the router acks or nacks, so it must be quick and must not block.
	Observer Observer
	// Tracer, when set, is told where each delivery and each of its phases (claim, handler,
	// commit, dead letter) start and end, and injects trace context into dead letters and
	// produced messages (see Tracer; middleware/inboxtrace implements it with OpenTelemetry).
	Tracer Tracer

	// Batch turns on group commit: deliveries in the inbox at the same moment share one
	// transaction and one COMMIT. The zero value is off:
	// one transaction per delivery. See BatchConfig and docs/design.md, "Batched mode".
	Batch BatchConfig

	// TooOld refuses, before the claim, a message whose producer time is older than the
	// retention window (its inbox row may already be purged) or too far in the future: it
	// is dead-lettered with its reason and counts no attempt. Off unless
	// TooOld.ProducerTime is set. See TooOldGuard and docs/retention.md.
	TooOld TooOldGuard
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
	c.InvalidKeyBrake.setDefaults()
	c.Batch.setDefaults()
	c.TooOld.setDefaults(c.retentionWindow())
}

// retentionWindow is the shortest retention window among the stores (zero when none has one):
// the TooOldGuard's default, safe for every database.
func (c *Config) retentionWindow() time.Duration {
	var w time.Duration
	for _, s := range c.stores() {
		if sw := s.RetentionWindow(); sw > 0 && (w == 0 || sw < w) {
			w = sw
		}
	}
	return w
}

// needsProducerTime reports whether a store files claims by producer time.
func (c *Config) needsProducerTime() bool {
	for _, s := range c.stores() {
		if s.NeedsProducerTime() {
			return true
		}
	}
	return false
}

// Validate returns an error wrapping ErrInvalidConfig for a missing Store (neither Store nor
// Stores, or both; Stores empty, with a nil store or a route name that is not valid key
// material, or without Route; Route without Stores), an invalid
// ConsumerName, a negative duration, an unsupported isolation level, a dead-letter publisher
// without a topic (or the reverse), MaxAttempts below 1, a Store that needs producer times
// without ProducerTime, an unknown collision policy, a Batch setting that is negative, above
// MaxBatchSize or of an unknown Mode, or a TooOld guard
// without a window (none set and the Store has no retention window) or with a negative
// duration. New calls it after filling defaults.
func (c Config) Validate() error {
	if err := c.validateStores(); err != nil {
		return err
	}
	if err := ValidateConsumerName(c.ConsumerName); err != nil {
		return err
	}
	switch c.Isolation {
	case sql.LevelDefault, sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable:
	default:
		return fmt.Errorf("%w: isolation level %s is not supported (use READ COMMITTED, REPEATABLE READ or SERIALIZABLE)", ErrInvalidConfig, c.Isolation)
	}
	if c.FinishTimeout < 0 || c.ClaimTimeout < 0 || c.TxRetryBackoff < 0 || c.MaxTxRetryBackoff < 0 {
		return fmt.Errorf("%w: durations must not be negative", ErrInvalidConfig)
	}
	if (c.DeadLetterPublisher == nil) != (c.DeadLetterTopic == "") {
		return fmt.Errorf("%w: DeadLetterPublisher and DeadLetterTopic must be set together", ErrInvalidConfig)
	}
	if c.MaxAttempts < 1 {
		return fmt.Errorf("%w: MaxAttempts must be at least 1", ErrInvalidConfig)
	}
	if !c.InvalidKeyBrake.Disabled {
		if err := c.InvalidKeyBrake.validate(); err != nil {
			return err
		}
	}
	if c.needsProducerTime() && c.ProducerTime == nil {
		return fmt.Errorf("%w: the Store files claims by producer time (a partitioned table): set ProducerTime", ErrInvalidConfig)
	}
	if c.OnKeyCollision < CollisionDeadLetter || c.OnKeyCollision > CollisionSkip {
		return fmt.Errorf("%w: unknown OnKeyCollision policy %d", ErrInvalidConfig, c.OnKeyCollision)
	}
	if err := c.Batch.validate(); err != nil {
		return err
	}
	return c.TooOld.Validate()
}
