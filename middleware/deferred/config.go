package deferred

import (
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"github.com/watermill-inbox/watermill-inbox/internal/ident"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Defaults that New applies to zero Config fields.
const (
	// DefaultSchema holds the table unless Config.Schema says otherwise.
	DefaultSchema = "public"
	// DefaultTable is the store-then-process inbox table's name.
	DefaultTable = "inbox_deferred"
	// DefaultAggregateField is the metadata field read for the aggregate key (rows of one
	// aggregate are handled one at a time, in order). A message without it has no ordering
	// constraint.
	DefaultAggregateField = "aggregate_id"
	// DefaultBatchSize is the number of rows one claim takes.
	DefaultBatchSize = 50
	// DefaultWorkers is the number of worker goroutines per Workers.
	DefaultWorkers = 4
	// DefaultPollInterval is the fallback poll of an idle worker (a lost notification only
	// delays a row by up to this much).
	DefaultPollInterval = time.Second
	// DefaultLease is how long a claim may stay in processing without its row's transaction
	// before the reaper returns it to pending (the seed's five minutes). It is also the
	// idle-in-transaction limit of a row's transaction.
	DefaultLease = 5 * time.Minute
	// DefaultMaxAttempts is the number of handler runs after which a failing row is dead.
	DefaultMaxAttempts = 5
	// DefaultBackoff is the first retry delay of a failed row; it doubles per attempt.
	DefaultBackoff = time.Second
	// DefaultMaxBackoff caps the retry delay.
	DefaultMaxBackoff = 5 * time.Minute
	// DefaultShutdownTimeout is how long Close lets the rows being handled finish before it
	// cancels their handlers' contexts.
	DefaultShutdownTimeout = 10 * time.Second
	// DefaultFinishTimeout bounds statements run detached from a cancelled context (commit,
	// rollback, releasing claims).
	DefaultFinishTimeout = 10 * time.Second
	// DefaultFirstSequence is the first producer sequence number of every aggregate.
	DefaultFirstSequence = 1
	// DefaultMaxInFlightBytes is the byte budget of one Workers: 64 MiB of payload and
	// metadata loaded at once, across its workers.
	DefaultMaxInFlightBytes = 64 << 20
	// DefaultStuckAfter is how long an aggregate's head may wait before Stats counts the
	// aggregate as stuck.
	DefaultStuckAfter = 5 * time.Minute
)

// Ordering chooses the order of the rows of one aggregate.
type Ordering int

const (
	// OrderArrival handles the rows of an aggregate in arrival order (the id column, assigned
	// at receipt). Default.
	OrderArrival Ordering = iota
	// OrderProducerSequence handles them in the order of a producer sequence number read
	// from metadata (Config.SequenceField): contiguous integers per aggregate starting at
	// Config.FirstSequence. A row waits until its predecessor (sequence-1) is done, so a
	// message the broker delivers late holds its aggregate until it arrives.
	OrderProducerSequence
)

// AfterDead is what a dead row does to the later rows of its aggregate.
type AfterDead int

const (
	// HoldAggregate keeps the later rows of a dead row's aggregate pending until the dead
	// row is replayed and done (or replayed and dead again under ContinueAggregate). Default:
	// order is never broken silently; Stats shows the held rows as pending and aging.
	HoldAggregate AfterDead = iota
	// ContinueAggregate treats a dead row as finished: the aggregate's later rows proceed.
	ContinueAggregate
)

// AggregateKeyExtractor returns a message's aggregate key; "" means no ordering constraint.
type AggregateKeyExtractor func(msg *message.Message) string

// MetadataAggregateKey returns an AggregateKeyExtractor reading the metadata field.
func MetadataAggregateKey(field string) AggregateKeyExtractor {
	return func(msg *message.Message) string { return msg.Metadata.Get(field) }
}

// Config configures a store-then-process inbox for one consumer. Zero values take the
// defaults documented on each field.
type Config struct {
	// Pool is the database (required). Receipt takes one connection per statement; each
	// worker holds one while it handles a row; the listener holds a dedicated connection of
	// its own (not from the pool).
	Pool *pgxpool.Pool
	// Schema and Table name the table (defaults DefaultSchema, DefaultTable); validated by
	// pgstore.ValidateIdentifier (Table at most 40 bytes, so derived index names fit).
	Schema, Table string
	// ConsumerName identifies the handler (required; inbox.New's rule: not blank, at most
	// inbox.MaxConsumerNameBytes bytes of valid UTF-8 without NUL or control characters).
	// Half of the unique key.
	ConsumerName string
	// KeyExtractor returns each message's key. Default: inbox.MessageUUID(). Build a
	// metadata one with inbox.MetadataKey, which refuses broker-side fields.
	KeyExtractor inbox.KeyExtractor
	// AggregateKey returns a message's aggregate key. Default:
	// MetadataAggregateKey(DefaultAggregateField). An aggregate key that ValidateKey refuses
	// (over inbox.MaxKeyBytes, NUL, invalid UTF-8) makes the message a poison message at
	// receipt (dead-lettered, or refused without a dead-letter topic).
	AggregateKey AggregateKeyExtractor
	// Ordering orders the rows of one aggregate. Default: OrderArrival.
	Ordering Ordering
	// SequenceField is the metadata field holding the producer sequence (a decimal int64),
	// required with OrderProducerSequence. A message with an aggregate key whose sequence the
	// order can never reach (missing, not a decimal int64, below FirstSequence, or already
	// used in its aggregate by a message with another payload) is refused at receipt with a
	// *SequenceError, like an invalid key.
	SequenceField string
	// FirstSequence is the first sequence number of every aggregate, with
	// OrderProducerSequence. Default: DefaultFirstSequence; set ZeroFirstSequence for 0.
	FirstSequence int64
	// ZeroFirstSequence makes FirstSequence 0 (a zero FirstSequence otherwise means the
	// default, 1).
	ZeroFirstSequence bool
	// AfterDead decides what a dead row does to its aggregate's later rows. Default:
	// HoldAggregate.
	AfterDead AfterDead

	// BatchSize is the number of rows one claim takes (rows). Default: DefaultBatchSize. The
	// claim reads no payload: the rows of a claim wait in a queue that every worker of the
	// Workers takes from, so one claim never keeps the other workers idle.
	BatchSize int
	// MaxInFlightBytes is the byte budget of one Workers (bytes): a worker loads a row's
	// payload and metadata only when it starts the row, after reserving their size from the
	// budget, and returns it when the row is settled, so the rows loaded at once never exceed
	// it (a single row larger than the budget is loaded alone, once every other row has been
	// returned). The Go heap holds about twice as much at its peak (pgx's read buffer beside
	// each payload). Default: DefaultMaxInFlightBytes.
	MaxInFlightBytes int64
	// StuckAfter is the wait after which Stats counts an aggregate as stuck: its head (the
	// first unfinished row in its order) is pending, or dead under HoldAggregate with rows
	// waiting behind it, and was received longer ago than this. Default: DefaultStuckAfter.
	StuckAfter time.Duration
	// Workers is the number of worker goroutines of Workers. Default: DefaultWorkers.
	Workers int
	// PollInterval is an idle worker's fallback poll. Default: DefaultPollInterval.
	PollInterval time.Duration
	// Lease bounds a claim: a row in processing whose claim is older than Lease and whose
	// transaction is not open (its worker died, or it was claimed and never started) returns
	// to pending, with a new token at its next claim. It is also set as the row
	// transaction's idle_in_transaction_session_timeout, so a worker stalled inside its
	// handler past it loses its session (its writes roll back) and its row is reaped. It
	// must exceed the longest handler run. Default: DefaultLease.
	Lease time.Duration
	// ReapInterval is how often the reaper runs. Default: Lease/4, at most 30 s.
	ReapInterval time.Duration
	// MaxAttempts is the number of handler runs (crashes included) after which a failing row
	// is dead. Default: DefaultMaxAttempts.
	MaxAttempts int
	// Backoff is the first retry delay; the n-th retry waits Backoff*2^(n-1), capped by
	// MaxBackoff, with jitter (between half and all of it). Defaults: DefaultBackoff,
	// DefaultMaxBackoff.
	Backoff, MaxBackoff time.Duration
	// ShutdownTimeout is how long Close lets rows being handled finish before it cancels
	// their contexts. Default: DefaultShutdownTimeout.
	ShutdownTimeout time.Duration
	// FinishTimeout bounds statements run detached from a cancelled context. Default:
	// DefaultFinishTimeout.
	FinishTimeout time.Duration
	// WorkerName is stored in claimed_by. Default: "<hostname>-<pid>".
	WorkerName string

	// DeadLetterPublisher and DeadLetterTopic, set together, publish dead rows (and
	// messages refused at receipt: invalid key, collision) with Watermill's PoisonQueue
	// metadata keys and the inbox's (inbox.DeadLetterAttemptsKey...). Without them a dead
	// row stays in the table only, and a message refused at receipt is nacked.
	DeadLetterPublisher message.Publisher
	// DeadLetterTopic: see DeadLetterPublisher.
	DeadLetterTopic string
	// OnKeyCollision decides what a receipt with a known key and another payload does, as in
	// the immediate inbox. Default: inbox.CollisionDeadLetter.
	OnKeyCollision inbox.CollisionPolicy
	// BrokerSideFields names the broker's delivery fields (adapters' BrokerSideFields), not
	// stored with the row and removed from dead letters.
	BrokerSideFields map[string]string

	// Outbox receives the messages the handler returns, in the row's transaction, for
	// PublishTopic. Without it a handler that returns messages fails
	// (inbox.ErrProducedMessages).
	Outbox inbox.Outbox
	// PublishTopic is the topic of the handler's returned messages.
	PublishTopic string

	// Retention is the retention window of the consumer's done rows, used by PurgeExpired
	// (and the background purger, package middleware/retention, or the CLI's deferred purge):
	// done rows whose done_at is older than Window are purged; pending, processing and dead
	// rows never are by age. The zero value configures no retention (PurgeExpired refuses
	// with pgstore.ErrNoRetention); a set one takes inbox.Retention's defaults and is
	// validated the same way as the immediate inbox's (inbox.Retention.Validate: Window at
	// least MaxRedelivery + Margin, else an *inbox.RetentionError). DeadLetterWindow is
	// unused here: dead rows stay until replayed. See docs/retention.md.
	Retention inbox.Retention
	// TooOld refuses at receipt a message whose producer time is older than the retention
	// window (its evidence, the done row, may already be purged, so a copy could be processed
	// twice), or further in the future than the clock skew allows: dead-lettered with
	// inbox.ReasonTooOld or inbox.ReasonFutureProducerTime (or, without a dead-letter topic,
	// nacked with a permanent error) instead of inserted. The immediate inbox's guard, same
	// options: off while ProducerTime is nil; Window zero takes Retention.Window;
	// ProcessTooOld inserts such a message anyway, with a warning.
	TooOld inbox.TooOldGuard
}

func (c *Config) setDefaults() {
	if c.Schema == "" {
		c.Schema = DefaultSchema
	}
	if c.Table == "" {
		c.Table = DefaultTable
	}
	if c.KeyExtractor == nil {
		c.KeyExtractor = inbox.MessageUUID()
	}
	if c.AggregateKey == nil {
		c.AggregateKey = MetadataAggregateKey(DefaultAggregateField)
	}
	if c.FirstSequence == 0 && !c.ZeroFirstSequence {
		c.FirstSequence = DefaultFirstSequence
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.Workers == 0 {
		c.Workers = DefaultWorkers
	}
	if c.MaxInFlightBytes == 0 {
		c.MaxInFlightBytes = DefaultMaxInFlightBytes
	}
	if c.StuckAfter == 0 {
		c.StuckAfter = DefaultStuckAfter
	}
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.Lease == 0 {
		c.Lease = DefaultLease
	}
	if c.ReapInterval == 0 {
		c.ReapInterval = min(c.Lease/4, 30*time.Second)
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.Backoff == 0 {
		c.Backoff = DefaultBackoff
	}
	if c.MaxBackoff == 0 {
		c.MaxBackoff = DefaultMaxBackoff
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.FinishTimeout == 0 {
		c.FinishTimeout = DefaultFinishTimeout
	}
	if c.Retention != (inbox.Retention{}) {
		c.Retention = c.Retention.WithDefaults()
	}
	c.TooOld = c.TooOld.WithDefaults(c.Retention.Window)
	if c.WorkerName == "" {
		host, _ := os.Hostname()
		c.WorkerName = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
}

// Validate returns an error wrapping inbox.ErrInvalidConfig for a missing pool, an invalid
// schema or table name, a consumer name inbox.New refuses (inbox.ValidateConsumerName), a
// negative or too small duration, a batch size, worker count or byte budget below 1, an unknown
// ordering or policy, OrderProducerSequence without SequenceField, a dead-letter publisher
// without a topic (or the reverse), messages to publish without a topic, a SequenceField that
// is a broker-side field (inbox.ErrBrokerSideKey), a Retention that inbox.Retention.Validate
// refuses (an *inbox.RetentionError), or a TooOld guard that inbox.TooOldGuard.Validate refuses
// (no window: neither TooOld.Window nor Retention).
func (c Config) Validate() error {
	for _, check := range []func() error{c.validateNames, c.validateLimits, c.validatePolicies} {
		if err := check(); err != nil {
			return err
		}
	}
	if c.Retention != (inbox.Retention{}) {
		if err := c.Retention.Validate(); err != nil {
			return err
		}
	}
	return c.TooOld.Validate()
}

// validateNames checks the pool, the table's names and the consumer name.
func (c Config) validateNames() error {
	if c.Pool == nil {
		return fmt.Errorf("%w: deferred: Pool is required", inbox.ErrInvalidConfig)
	}
	if err := ident.Validate("deferred: schema name", c.Schema, 63); err != nil {
		return err
	}
	if err := ident.Validate("deferred: table name", c.Table, 40); err != nil {
		return err
	}
	return inbox.ValidateConsumerName(c.ConsumerName)
}

// validateLimits checks the sizes and durations.
func (c Config) validateLimits() error {
	switch {
	case c.BatchSize < 1 || c.Workers < 1:
		return fmt.Errorf("%w: deferred: BatchSize and Workers must be at least 1", inbox.ErrInvalidConfig)
	case c.MaxInFlightBytes < 1:
		return fmt.Errorf("%w: deferred: MaxInFlightBytes must be at least 1", inbox.ErrInvalidConfig)
	case c.MaxAttempts < 1:
		return fmt.Errorf("%w: deferred: MaxAttempts must be at least 1", inbox.ErrInvalidConfig)
	case c.PollInterval < 0 || c.ReapInterval < 0 || c.Backoff < 0 || c.MaxBackoff < 0 || c.ShutdownTimeout < 0 ||
		c.FinishTimeout < 0 || c.StuckAfter < 0:
		return fmt.Errorf("%w: deferred: durations must not be negative", inbox.ErrInvalidConfig)
	case c.Lease < time.Second:
		return fmt.Errorf("%w: deferred: Lease must be at least 1s (it is also the row transaction's idle_in_transaction_session_timeout)", inbox.ErrInvalidConfig)
	}
	return nil
}

// validatePolicies checks the ordering, the dead-letter and outbox settings and the policies.
func (c Config) validatePolicies() error {
	switch {
	case c.Ordering != OrderArrival && c.Ordering != OrderProducerSequence:
		return fmt.Errorf("%w: deferred: unknown Ordering %d", inbox.ErrInvalidConfig, c.Ordering)
	case c.Ordering == OrderProducerSequence && strings.TrimSpace(c.SequenceField) == "":
		return fmt.Errorf("%w: deferred: OrderProducerSequence needs SequenceField", inbox.ErrInvalidConfig)
	case c.AfterDead != HoldAggregate && c.AfterDead != ContinueAggregate:
		return fmt.Errorf("%w: deferred: unknown AfterDead policy %d", inbox.ErrInvalidConfig, c.AfterDead)
	case (c.DeadLetterPublisher == nil) != (c.DeadLetterTopic == ""):
		return fmt.Errorf("%w: deferred: DeadLetterPublisher and DeadLetterTopic must be set together", inbox.ErrInvalidConfig)
	case c.Outbox != nil && c.PublishTopic == "":
		return fmt.Errorf("%w: deferred: an Outbox needs PublishTopic", inbox.ErrInvalidConfig)
	case c.OnKeyCollision < inbox.CollisionDeadLetter || c.OnKeyCollision > inbox.CollisionSkip:
		return fmt.Errorf("%w: deferred: unknown OnKeyCollision policy %d", inbox.ErrInvalidConfig, c.OnKeyCollision)
	case c.Ordering == OrderProducerSequence && brokerside.IsDeliveryState(c.SequenceField, c.BrokerSideFields):
		return fmt.Errorf("%w: deferred: SequenceField %q is a broker-side delivery field, not a producer sequence", inbox.ErrBrokerSideKey, c.SequenceField)
	}
	return nil
}
