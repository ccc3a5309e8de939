package deferred

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"github.com/watermill-inbox/watermill-inbox/internal/keyrule"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Status is a row's state.
type Status string

// The states of a row. A row moves pending -> processing -> done, or back to pending after a
// failure (with a backoff) or a reap, or to dead after Config.MaxAttempts handler runs or a
// permanent error. Replay moves done and dead rows back to pending.
const (
	// StatusPending: received, waiting for a worker (or for its backoff, or for an earlier
	// row of its aggregate).
	StatusPending Status = "pending"
	// StatusProcessing: claimed by a worker (claimed_at, claimed_by, claim_token set).
	StatusProcessing Status = "processing"
	// StatusDone: the handler ran and its transaction committed with the row marked done.
	StatusDone Status = "done"
	// StatusDead: failed permanently or MaxAttempts times; never purged by age.
	StatusDead Status = "dead"
)

// ErrInvalidMetadata is wrapped by the *UnstorableError returned (permanent) at receipt for a
// message whose metadata cannot be stored as JSON text without altering it: a key or value
// that is not valid UTF-8 or holds NUL (PostgreSQL jsonb refuses \u0000: SQLSTATE 22P05), or
// more than jsonb holds.
var ErrInvalidMetadata = errors.New("deferred: metadata is not valid UTF-8 text without NUL")

// ErrInvalidSequence is wrapped by the *SequenceError returned (permanent) at receipt, with
// OrderProducerSequence, for a message with an aggregate key whose sequence field is missing,
// not a decimal int64, or below Config.FirstSequence.
var ErrInvalidSequence = errors.New("deferred: missing or invalid producer sequence")

// Counters are the inbox's counters since New, for metrics. Rows counts come from Stats.
type Counters struct {
	// Received counts receipts that stored a new row.
	Received uint64
	// Duplicates counts receipts of a key already stored (acked, nothing stored).
	Duplicates uint64
	// Collisions counts receipts of a known key with another payload.
	Collisions uint64
	// Refused counts receipts refused (invalid key, metadata or sequence, too old or
	// future-dated), dead-lettered or nacked.
	Refused uint64
	// TooOld counts the receipts among Refused that Config.TooOld refused (older than the
	// retention window, or future-dated beyond the clock skew).
	TooOld uint64
	// Done counts rows this process's workers marked done.
	Done uint64
	// Failed counts handler runs that failed (the row went back to pending or dead).
	Failed uint64
	// Dead counts rows this process's workers marked dead.
	Dead uint64
	// Fenced counts rows a worker could not start or finish because its claim token no longer
	// matched (the reaper had released the row).
	Fenced uint64
	// Reaped counts rows the reaper returned to pending.
	Reaped uint64
}

// Inbox is the store-then-process inbox of one consumer: Receive stores deliveries, the
// Workers made by NewWorkers handle the stored rows. Safe for concurrent use.
type Inbox struct {
	cfg    Config
	n      *names
	logger watermill.LoggerAdapter

	received, duplicates, collisions, refused, tooOld atomic.Uint64
	done, failed, dead, fenced, reaped                atomic.Uint64

	notifyMu               sync.Mutex
	notifying, notifyAgain bool
}

// New returns an Inbox, or an error wrapping inbox.ErrInvalidConfig. It does not touch the
// database: call Migrate (or run MigrationSQL's script) first. A nil logger discards logs;
// logs never carry payloads.
func New(cfg Config, logger watermill.LoggerAdapter) (*Inbox, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Inbox{cfg: cfg, n: newNames(cfg), logger: logger.With(watermill.LogFields{"consumer_name": cfg.ConsumerName, "mode": "store-then-process"})}, nil
}

// ConsumerName returns the configured consumer name.
func (i *Inbox) ConsumerName() string { return i.cfg.ConsumerName }

// Config returns the configuration with defaults filled.
func (i *Inbox) Config() Config { return i.cfg }

// Table returns the quoted, schema-qualified table name.
func (i *Inbox) Table() string { return i.n.qtable }

// Channel returns the NOTIFY channel receipts and replays notify (unquoted).
func (i *Inbox) Channel() string { return i.n.channel }

// Counters returns a snapshot of the counters.
func (i *Inbox) Counters() Counters {
	return Counters{
		Received: i.received.Load(), Duplicates: i.duplicates.Load(), Collisions: i.collisions.Load(),
		Refused: i.refused.Load(), TooOld: i.tooOld.Load(), Done: i.done.Load(), Failed: i.failed.Load(), Dead: i.dead.Load(),
		Fenced: i.fenced.Load(), Reaped: i.reaped.Load(),
	}
}

// Receive is the receipt: a message.NoPublishHandlerFunc for any subscriber. It extracts and
// validates the key (the immediate inbox's KeyExtractor and inbox.ValidateKey), the aggregate
// key and (OrderProducerSequence) the sequence, then inserts the message with status pending,
// insert-first (INSERT ... ON CONFLICT DO NOTHING: the unique key, and the unique producer
// sequence of an aggregate) in one
// statement (its own transaction). It returns nil only after that commit, so the router acks
// after it; the workers are then notified (see notify).
//
//   - A duplicate (the key is stored) returns nil: acked, nothing stored. With another
//     payload hash it is a key collision, handled by Config.OnKeyCollision.
//   - A message the table cannot hold or the order can never reach is a poison message,
//     refused before the insert with a permanent error: an invalid key or aggregate key (an
//     *inbox.InvalidKeyError), a topic, metadata, payload or row the table cannot hold (an
//     *UnstorableError, also for an insert PostgreSQL refuses with SQLSTATE class 22 or 54),
//     or a producer sequence that is missing, not a number, below FirstSequence or already
//     used in the aggregate with another payload (a *SequenceError). It is dead-lettered with
//     "permanent error: " and the error as its reason and acked with a dead-letter topic,
//     else the permanent error is returned (nack; inbox.IsPermanent reports it), never a
//     retryable one.
//   - With Config.TooOld on, a message older than the retention window (or future-dated
//     beyond the clock skew) is refused the same way, before the insert, with the reason
//     inbox.ReasonTooOld (inbox.ReasonFutureProducerTime) and an error wrapping
//     inbox.ErrTooOld (inbox.ErrFutureProducerTime); nothing is stored for it.
//   - A database error is returned (nack); if the insert had committed, the redelivery is a
//     duplicate.
func (i *Inbox) Receive(msg *message.Message) error {
	select {
	case <-msg.Acked():
		return inbox.ErrAckedBeforeHandler
	default:
	}
	ctx := msg.Context()
	key, err := i.cfg.KeyExtractor.ExtractKey(msg)
	if err != nil {
		err = inbox.Permanent(fmt.Errorf("deferred: extracting key from %s: %w", i.cfg.KeyExtractor.Source(), err))
	} else {
		err = inbox.ValidateKey(i.cfg.KeyExtractor.Source(), key)
	}
	if err != nil {
		return i.refuse(msg, "", err)
	}
	if reason, err := i.cfg.TooOld.Check(msg, i.logger); err != nil {
		// Too old or future-dated: before the insert, so its row may already be purged and
		// nothing is written for it.
		i.tooOld.Add(1)
		return i.refuseWith(msg, key, err, reason)
	}
	r, err := i.prepare(msg, key)
	if err != nil {
		return i.refuse(msg, key, err)
	}
	var id int64
	err = i.cfg.Pool.QueryRow(ctx, i.n.receiveSQL, key, i.cfg.ConsumerName, r.uuid, r.aggregate, r.seq,
		r.topic, r.payload, r.sum[:], r.metadata).Scan(&id)
	switch {
	case err == nil:
		i.received.Add(1)
		i.notify()
		return nil
	case errors.Is(err, pgx.ErrNoRows):
		return i.conflict(msg, r)
	}
	if perm := unstorableByPostgres(err, r); perm != nil {
		return i.refuse(msg, key, perm)
	}
	return fmt.Errorf("deferred: receipt of %s: %w", keyrule.SafeID(msg.UUID), err)
}

// conflict settles a receipt whose insert conflicted: with the row of its key (a duplicate,
// or a key collision for another payload, handled by Config.OnKeyCollision), or with the row
// at its producer sequence under another key (the same payload is a duplicate; another one is
// refused with a *SequenceError wrapping ErrSequenceReused).
func (i *Inbox) conflict(msg *message.Message, r receipt) error {
	ctx := msg.Context()
	var stored []byte
	var sameKey bool
	if err := i.cfg.Pool.QueryRow(ctx, i.n.conflictSQL, r.key, i.cfg.ConsumerName, r.aggregate, r.seq).Scan(&stored, &sameKey); err != nil {
		// The row exists (the insert conflicted): ack as a duplicate, collision unchecked.
		i.logger.Error("Duplicate receipt: could not read the stored payload hash", err, watermill.LogFields{"message_uuid": keyrule.SafeID(msg.UUID)})
		i.duplicates.Add(1)
		return nil
	}
	if bytes.Equal(stored, r.sum[:]) {
		i.duplicates.Add(1)
		i.logger.Debug("Duplicate receipt skipped", watermill.LogFields{"message_uuid": keyrule.SafeID(msg.UUID), "same_key": sameKey})
		return nil
	}
	if !sameKey {
		return i.refuse(msg, r.key, inbox.Permanent(&SequenceError{Field: i.cfg.SequenceField, Sequence: *r.seq, Reason: reasonReused}))
	}
	i.collisions.Add(1)
	i.logger.Error("Key collision: key already stored with a different payload", inbox.ErrKeyCollision,
		watermill.LogFields{"message_uuid": keyrule.SafeID(msg.UUID), "policy": i.cfg.OnKeyCollision})
	switch {
	case i.cfg.OnKeyCollision == inbox.CollisionSkip:
		return nil
	case i.cfg.OnKeyCollision == inbox.CollisionDeadLetter && i.cfg.DeadLetterPublisher != nil:
		return i.publishDeadLetter(ctx, msg, r.key, inbox.ErrKeyCollision.Error(), 0, r.topic)
	}
	return inbox.ErrKeyCollision
}

// notify wakes the workers of every process after a receipt committed: one pg_notify at a
// time, on its own, coalescing the receipts that commit meanwhile into the next one. Sent in
// the receipt's transaction instead, NOTIFY's database-wide lock would be held through every
// receipt's commit and serialise them (measured: 3.5 times fewer receipts per second at 8
// concurrent receipts). A notification lost to a crash only delays the row by the poll
// interval.
func (i *Inbox) notify() {
	i.notifyMu.Lock()
	if i.notifying {
		i.notifyAgain = true
		i.notifyMu.Unlock()
		return
	}
	i.notifying = true
	i.notifyMu.Unlock()
	go func() {
		for {
			ctx, cancel := context.WithTimeout(context.Background(), i.cfg.FinishTimeout)
			if _, err := i.cfg.Pool.Exec(ctx, "SELECT pg_notify($1, $2)", i.n.channel, i.cfg.ConsumerName); err != nil {
				i.logger.Debug("NOTIFY failed; the workers' poll picks the rows up", watermill.LogFields{"error": err.Error()})
			}
			cancel()
			i.notifyMu.Lock()
			if !i.notifyAgain {
				i.notifying = false
				i.notifyMu.Unlock()
				return
			}
			i.notifyAgain = false
			i.notifyMu.Unlock()
		}
	}()
}

// Refuse settles msg as a poison message refused before its receipt, as Receive settles one:
// counted in Counters.Refused, logged, and dead-lettered and acked (nil) with "permanent
// error: " and err as its reason when the inbox has a dead-letter topic (the dead letter names
// no message key), else err is returned (nack). err should be permanent (inbox.IsPermanent).
// The router's store-then-process mode over several databases refuses with it a message whose
// route names no database (an *inbox.RouteError).
func (i *Inbox) Refuse(msg *message.Message, err error) error { return i.refuse(msg, "", err) }

// refuse settles a poison message at receipt: dead-lettered (nil: ack) or its error (nack).
func (i *Inbox) refuse(msg *message.Message, key string, err error) error {
	return i.refuseWith(msg, key, err, "permanent error: "+err.Error())
}

// refuseWith is refuse with the dead letter's reason given.
func (i *Inbox) refuseWith(msg *message.Message, key string, err error, reason string) error {
	i.refused.Add(1)
	i.logger.Error("Message refused at receipt", err, watermill.LogFields{"message_uuid": keyrule.SafeID(msg.UUID), "reason": reason})
	if i.cfg.DeadLetterPublisher == nil {
		return err
	}
	return i.publishDeadLetter(msg.Context(), msg, key, reason, 0, message.SubscribeTopicFromCtx(msg.Context()))
}

// publishDeadLetter publishes a copy of msg to the dead-letter topic with the PoisonQueue
// metadata keys and the inbox's; broker-side fields are removed. It returns the publish error.
func (i *Inbox) publishDeadLetter(ctx context.Context, msg *message.Message, key, reason string, attempts int, topic string) error {
	dl := message.NewMessage(msg.UUID, msg.Payload)
	for k, v := range msg.Metadata {
		if !brokerside.IsDeliveryState(k, i.cfg.BrokerSideFields) {
			dl.Metadata.Set(k, v)
		}
	}
	handler := message.HandlerNameFromCtx(ctx)
	if handler == "" {
		handler = i.cfg.ConsumerName
	}
	dl.Metadata.Set(wmmiddleware.ReasonForPoisonedKey, reason)
	dl.Metadata.Set(wmmiddleware.PoisonedTopicKey, topic)
	dl.Metadata.Set(wmmiddleware.PoisonedHandlerKey, handler)
	dl.Metadata.Set(wmmiddleware.PoisonedSubscriberKey, message.SubscriberNameFromCtx(ctx))
	dl.Metadata.Set(inbox.DeadLetterAttemptsKey, strconv.Itoa(attempts))
	dl.Metadata.Set(inbox.DeadLetterConsumerKey, i.cfg.ConsumerName)
	dl.Metadata.Set(inbox.DeadLetterMessageKeyKey, key)
	if err := i.cfg.DeadLetterPublisher.Publish(i.cfg.DeadLetterTopic, dl); err != nil {
		return fmt.Errorf("deferred: publishing dead letter of %s: %w", keyrule.SafeID(msg.UUID), err)
	}
	i.logger.Info("Message dead-lettered", watermill.LogFields{"message_uuid": keyrule.SafeID(msg.UUID), "attempts": attempts, "reason": reason})
	return nil
}

// Stats is a snapshot of the table for one consumer, for metrics, read from the partial indexes
// of unfinished rows (its cost follows the backlog, not the history).
type Stats struct {
	// Pending is the number of pending rows (including rows waiting for their backoff or for
	// an earlier row of their aggregate).
	Pending int64
	// OldestPendingAge is now minus the oldest pending row's received_at (database clock);
	// zero when none is pending.
	OldestPendingAge time.Duration
	// Processing is the number of rows claimed by workers.
	Processing int64
	// Dead is the number of dead rows.
	Dead int64
	// StuckAggregates is the number of aggregates whose head (the first unfinished row in the
	// aggregate's order) was received longer than Config.StuckAfter ago and waits: pending (a
	// gap before it in producer sequences, a row failing with backoff, or workers behind), or
	// dead under HoldAggregate with pending rows behind it. A head being processed is not
	// counted.
	StuckAggregates int64
	// Counters are this process's counters (Reaped among them).
	Counters Counters
}

// Stats reads the consumer's row counts in one statement, from the partial indexes of
// unfinished, processing and dead rows (done rows are never read); the stuck aggregates cost
// one index descent per aggregate with unfinished rows, as a claim's scan does. Errors are
// pgx's, wrapped.
func (i *Inbox) Stats(ctx context.Context) (Stats, error) {
	var s Stats
	var oldest *time.Time
	var now time.Time
	if err := i.cfg.Pool.QueryRow(ctx, i.n.statsSQL, i.cfg.ConsumerName, i.cfg.StuckAfter.Seconds()).Scan(&s.Pending, &oldest, &s.Processing, &s.Dead, &s.StuckAggregates, &now); err != nil {
		return s, fmt.Errorf("deferred: stats: %w", err)
	}
	if oldest != nil {
		s.OldestPendingAge = max(now.Sub(*oldest), 0)
	}
	s.Counters = i.Counters()
	return s, nil
}

// ReplayParams select the rows Replay resets. Rows of this consumer only; every set field
// must match.
type ReplayParams struct {
	// Keys, when non-empty, limits the replay to these message keys.
	Keys []string
	// From and To, when non-zero, limit it to rows received in [From, To).
	From, To time.Time
	// Statuses are the states to replay: StatusDone and/or StatusDead. Empty means both.
	// Pending and processing rows are never touched.
	Statuses []Status
}

// ErrReplayStatus is returned by Replay for a status other than done or dead.
var ErrReplayStatus = errors.New("deferred: only done and dead rows can be replayed")

// Replay resets the selected done and dead rows to pending with their attempts at zero, in
// one statement, and wakes the workers. It returns the number of rows reset. A replayed row
// is handled again in its aggregate's order among the rows still unfinished; rows of the
// aggregate that were done after it are not rolled back. Errors: ErrReplayStatus, an
// *inbox.InvalidKeyError for an invalid key, pgx's errors wrapped.
func (i *Inbox) Replay(ctx context.Context, p ReplayParams) (int64, error) {
	statuses := []string{string(StatusDone), string(StatusDead)}
	if len(p.Statuses) > 0 {
		statuses = statuses[:0]
		for _, s := range p.Statuses {
			if s != StatusDone && s != StatusDead {
				return 0, fmt.Errorf("%w: %q", ErrReplayStatus, s)
			}
			statuses = append(statuses, string(s))
		}
	}
	var keys []string
	for _, k := range p.Keys {
		if err := inbox.ValidateKey("replay key", k); err != nil {
			return 0, err
		}
		keys = append(keys, k)
	}
	var from, to *time.Time
	if !p.From.IsZero() {
		from = &p.From
	}
	if !p.To.IsZero() {
		to = &p.To
	}
	var n int64
	var ignored *string
	if err := i.cfg.Pool.QueryRow(ctx, i.n.replaySQL, i.cfg.ConsumerName, statuses, keys, from, to, i.n.channel).Scan(&n, &ignored); err != nil {
		return 0, fmt.Errorf("deferred: replay: %w", err)
	}
	i.logger.Info("Rows replayed", watermill.LogFields{"rows": n})
	return n, nil
}

// Row is a row as Get reads it, without its payload and metadata.
type Row struct {
	// ID is the arrival sequence.
	ID int64
	// MessageID is the key; MessageUUID the Watermill UUID as received.
	MessageID, MessageUUID string
	// AggregateKey is empty for a row without ordering constraint.
	AggregateKey string
	// Status is the row's state.
	Status Status
	// Attempts counts the handler runs started (crashes included).
	Attempts int
	// LastError is the last failure, truncated to 1 KiB; never the payload.
	LastError string
	// ReceivedAt is the receipt's time; NextAttemptAt the earliest next claim.
	ReceivedAt, NextAttemptAt time.Time
	// DoneAt and DeadAt are set once the row is done or dead.
	DoneAt, DeadAt *time.Time
	// ClaimedBy names the worker that claimed the row, then the one that started its last
	// run ("<WorkerName>/<n>").
	ClaimedBy string
}

// Get reads the row of key for this consumer; pgx.ErrNoRows (wrapped) when there is none.
func (i *Inbox) Get(ctx context.Context, key string) (Row, error) {
	var r Row
	var agg, lastErr, by *string
	var status string
	err := i.cfg.Pool.QueryRow(ctx, "SELECT id, message_id, message_uuid, aggregate_key, status, attempts, last_error, received_at, done_at, dead_at, claimed_by, next_attempt_at FROM "+
		i.n.qtable+" WHERE message_id = $1 AND consumer_name = $2", key, i.cfg.ConsumerName).
		Scan(&r.ID, &r.MessageID, &r.MessageUUID, &agg, &status, &r.Attempts, &lastErr, &r.ReceivedAt, &r.DoneAt, &r.DeadAt, &by, &r.NextAttemptAt)
	if err != nil {
		return r, fmt.Errorf("deferred: get: %w", err)
	}
	r.Status = Status(status)
	r.AggregateKey, r.LastError, r.ClaimedBy = deref(agg), deref(lastErr), deref(by)
	return r, nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
