package inbox

import (
	"errors"
	"fmt"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
)

// The errors of package inbox. Test for them with errors.Is.
var (
	// ErrInvalidKey is the sentinel wrapped by every *InvalidKeyError. Test for it with
	// errors.Is(err, ErrInvalidKey).
	ErrInvalidKey = errors.New("inbox: invalid message key")

	// ErrProducedMessages is returned (and nothing committed) when a handler wrapped by an inbox
	// without an Outbox returns messages for the router to publish. The router publishes them
	// after the inbox has committed, so a crash or a failed publish in between would lose them for
	// good: the redelivery is recognised as a duplicate and the handler does not run again.
	// Configure Config.Outbox (package outbox) so they are written in the inbox transaction.
	ErrProducedMessages = errors.New("inbox: handler returned messages but no Outbox is configured")

	// ErrNoPublishTopic is returned when a handler returns messages but the router gave it no
	// publish topic (it was added with Watermill's AddConsumerHandler, not AddHandler, or package
	// router's AddConsumer, not AddPublishingConsumer), and its context names
	// none (ContextWithPublishTopic). It is permanent.
	ErrNoPublishTopic = errors.New("inbox: handler returned messages but has no publish topic")

	// ErrBrokerSideKey is returned by MetadataKey when the named metadata field is a known
	// broker-side delivery identifier (a redelivered flag, a delivery counter, an offset, a receipt
	// handle): such a value describes one delivery, not the message, and changes on redelivery.
	ErrBrokerSideKey = errors.New("inbox: metadata field is a broker-side delivery identifier")

	// ErrKeyCollision reports a key collision: a delivery whose key was already claimed with a
	// different payload (the SHA-256 stored with the claim differs). Two producers minted the same
	// ID, or a producer reused one. It is permanent (see IsPermanent).
	ErrKeyCollision = errors.New("inbox: key collision: key already processed with another payload")

	// ErrAckedBeforeHandler is returned when a delivery reaches the inbox already acked, which
	// Watermill's InstantAck middleware (or a handler of its kind) does. An acked message is never
	// redelivered, so a crash before the commit would lose it: the inbox refuses to run the
	// handler under that setup. Remove InstantAck. It is permanent (see IsPermanent).
	ErrAckedBeforeHandler = errors.New("inbox: message acked before the inbox ran")

	// ErrInvalidConfig wraps every configuration error returned by New and by store constructors.
	ErrInvalidConfig = errors.New("inbox: invalid configuration")

	// ErrInvalidKeyFlood is returned (the router nacks; it is not permanent) for a delivery with an
	// invalid key while most recent deliveries had one too: a mistyped key field
	// (MetadataKey("orderId") where producers write order_id) or a producer that lost its IDs is
	// a configuration fault, and dead-lettering the whole stream would drain it. The messages stay
	// on the broker until an operator fixes the configuration. See InvalidKeyBrake.
	ErrInvalidKeyFlood = errors.New("inbox: invalid-key flood")

	// ErrNotDeadLettered is returned by ReplayDeadLetter when the dead letter's key is not in the
	// dead-lettered state for this consumer: already replayed, never marked (a key collision, whose
	// key belongs to the message that was processed), or dead-lettered by another consumer's inbox.
	ErrNotDeadLettered = errors.New("inbox: message not dead-lettered")

	// ErrTooOld is wrapped (and marked Permanent) for a message older than the retention window.
	ErrTooOld = errors.New("inbox: message " + ReasonTooOld)

	// ErrFutureProducerTime is wrapped (and marked Permanent) for a message whose producer time
	// lies in the future beyond TooOldGuard.MaxClockSkew.
	ErrFutureProducerTime = errors.New("inbox: " + ReasonFutureProducerTime)

	// ErrCommitRolledBack is wrapped by a commit error when the transaction certainly did not
	// commit: PostgreSQL answered COMMIT with ROLLBACK (a statement of the handler had failed),
	// COMMIT raised an error (a deferred constraint), or the handler had ended the transaction
	// (ErrTxEnded). The delivery is the message's failure. A commit error without it has an
	// unknown outcome: the inbox nacks and never dead-letters, since the redelivery tells.
	ErrCommitRolledBack = contract.ErrCommitRolledBack

	// ErrTxEnded is the failure of a delivery whose handler ended the inbox transaction it was
	// given, or tried to (Commit or Rollback on it, a COMMIT or ROLLBACK statement, a closed
	// connection): nacked, never acked, since what it wrote may be gone. It also wraps
	// ErrCommitRolledBack.
	ErrTxEnded = contract.ErrTxEnded
)

// InvalidKeyError reports why a message key (the producer's message ID or a business idempotency
// key) was refused. It wraps ErrInvalidKey and is permanent (see IsPermanent): the message is not
// processed, no row is written, and redelivering it cannot help. The key itself is never part of
// the error string when it is invalid UTF-8 or oversized; only its length in bytes is.
type InvalidKeyError struct {
	// Source names where the key was read, e.g. "message UUID" or `metadata "idempotency_key"`.
	Source string
	// Reason is one of "empty", "blank", "too long (limit N bytes)", "invalid UTF-8",
	// "contains NUL".
	Reason string
	// Length is the key's length in bytes.
	Length int
}

// Error returns "inbox: invalid message key from <source>: <reason> (<n> bytes)"; the key
// itself is never part of it.
func (e *InvalidKeyError) Error() string {
	return fmt.Sprintf("inbox: invalid message key from %s: %s (%d bytes)", e.Source, e.Reason, e.Length)
}

// Unwrap returns ErrInvalidKey.
func (e *InvalidKeyError) Unwrap() error { return ErrInvalidKey }

// permanentError marks an error after which redelivery cannot succeed.
type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// Permanent wraps err to mark it permanent: a retry or redelivery of the same message will fail
// the same way (a malformed payload, a business rule that rejects it). IsPermanent reports true
// for it and for any error that wraps it. Permanent(nil) returns nil.
//
// With a dead-letter topic configured (Config.DeadLetterPublisher), the inbox publishes a
// message whose handler returned a permanent error to it at once, without further attempts,
// and acks the original. Without one, the inbox returns the error (the router nacks); route it
// with Watermill's middleware.PoisonQueueWithFilter(pub, topic, IsPermanent) outside the inbox.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err: err}
}

// IsPermanent reports whether err is, or wraps, an error marked with Permanent, an
// *InvalidKeyError, a *RouteError, ErrProducedMessages, ErrKeyCollision, ErrAckedBeforeHandler
// or ErrNoPublishTopic: errors that redelivery cannot fix.
func IsPermanent(err error) bool {
	var p permanentError
	return errors.As(err, &p) || errors.Is(err, ErrInvalidKey) || errors.Is(err, ErrUnroutable) || errors.Is(err, ErrProducedMessages) ||
		errors.Is(err, ErrKeyCollision) || errors.Is(err, ErrAckedBeforeHandler) || errors.Is(err, ErrNoPublishTopic)
}
