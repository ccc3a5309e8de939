package deferred

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"github.com/watermill-inbox/watermill-inbox/internal/keyrule"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// MaxTopicBytes is the longest topic a receipt stores (bytes, UTF-8): the key's limit,
// inbox.MaxKeyBytes, above the topic and queue name limits of Kafka (249 characters), AMQP (255
// bytes) and SQS (80 characters).
const MaxTopicBytes = inbox.MaxKeyBytes

// The limits of what one row can hold, from PostgreSQL: a field value and a protocol message
// are each at most 1 GB (MaxAllocSize, 2^30 - 1 bytes), and a jsonb value at most 2^28 - 1
// bytes ("total size of jsonb object elements exceeds the maximum"). maxRowBytes leaves 1 MiB
// of the message to the other columns. Variables so that the tests can lower them.
var (
	maxRowBytes      = 1<<30 - 1<<20
	maxMetadataBytes = 1<<28 - 1
)

// ErrUnstorable is wrapped by every *UnstorableError.
var ErrUnstorable = errors.New("deferred: the message cannot be stored")

// UnstorableError is the permanent error of a receipt that the table cannot hold as it is: a
// topic, metadata key or value that is not valid UTF-8 or holds NUL (PostgreSQL text and jsonb
// refuse both: SQLSTATE 22021, 22P05), a topic over MaxTopicBytes, metadata over jsonb's limit,
// a payload or row over PostgreSQL's 1 GB limit, or a row PostgreSQL refused with a data
// exception or a program limit (SQLSTATE classes 22 and 54: the same row always fails). The
// message keys and aggregate keys are refused by inbox.ValidateKey (an *inbox.InvalidKeyError)
// instead. It wraps ErrUnstorable, and ErrInvalidMetadata for the metadata.
type UnstorableError struct {
	// Field names what was refused: "topic", "metadata", "payload" or "row".
	Field string
	// Reason says why: "invalid UTF-8", "contains NUL", "too long (limit 512 bytes)", or
	// "refused by PostgreSQL (SQLSTATE 22021)". Never the value itself.
	Reason string
	// Bytes is the size of what was refused (bytes).
	Bytes int
}

func (e *UnstorableError) Error() string {
	return fmt.Sprintf("deferred: cannot store the %s: %s (%d bytes)", e.Field, e.Reason, e.Bytes)
}

// Unwrap returns ErrUnstorable, and ErrInvalidMetadata when the metadata was refused.
func (e *UnstorableError) Unwrap() []error {
	if e.Field == "metadata" {
		return []error{ErrUnstorable, ErrInvalidMetadata}
	}
	return []error{ErrUnstorable}
}

// ErrSequenceReused is wrapped by a *SequenceError for a producer sequence that another message
// of the aggregate, with another payload, already holds.
var ErrSequenceReused = errors.New("deferred: producer sequence already used in its aggregate")

// SequenceError is the permanent error of a receipt, with OrderProducerSequence, whose producer
// sequence the ordering rule can never reach: missing or not a decimal int64, below
// Config.FirstSequence (the head of an aggregate is its lowest unfinished sequence, so such a
// row would hold its aggregate forever), or already used in its aggregate by a message with
// another payload (a row at a done sequence would run after its successors; one at a pending
// sequence would be a second message at one place of the order). It wraps ErrSequenceReused
// for the last kind, else ErrInvalidSequence.
type SequenceError struct {
	// Field is the metadata field read (Config.SequenceField).
	Field string
	// Sequence is the number read; zero when it did not parse.
	Sequence int64
	// Reason says why: "missing", "not a decimal int64", "below the first sequence 1", or
	// "used by another message with another payload".
	Reason string
}

func (e *SequenceError) Error() string {
	return fmt.Sprintf("deferred: producer sequence in metadata %q: %s", e.Field, e.Reason)
}

// Unwrap returns ErrSequenceReused or ErrInvalidSequence.
func (e *SequenceError) Unwrap() error {
	if e.Reason == reasonReused {
		return ErrSequenceReused
	}
	return ErrInvalidSequence
}

const reasonReused = "used by another message with another payload"

// receipt is a message as the receipt stores it.
type receipt struct {
	key, uuid, topic string
	aggregate        *string
	seq              *int64
	payload          []byte
	sum              [sha256.Size]byte
	metadata         string
}

// prepare checks what the row will hold and returns it, or a permanent error: an
// *inbox.InvalidKeyError for the aggregate key, a *SequenceError, an *UnstorableError.
func (i *Inbox) prepare(msg *message.Message, key string) (receipt, error) {
	r := receipt{key: key, uuid: msg.UUID, topic: message.SubscribeTopicFromCtx(msg.Context()), payload: msg.Payload}
	if err := checkText("topic", r.topic, MaxTopicBytes); err != nil {
		return r, inbox.Permanent(err)
	}
	if a := i.cfg.AggregateKey(msg); a != "" {
		if err := inbox.ValidateKey("aggregate key", a); err != nil {
			return r, inbox.Permanent(err)
		}
		r.aggregate = &a
		if i.cfg.Ordering == OrderProducerSequence {
			seq, err := i.sequence(msg)
			if err != nil {
				return r, inbox.Permanent(err)
			}
			r.seq = &seq
		}
	}
	md, err := i.metadata(msg)
	if err != nil {
		return r, inbox.Permanent(err)
	}
	r.metadata = md
	if len(r.payload) > maxRowBytes {
		return r, inbox.Permanent(&UnstorableError{Field: "payload", Reason: fmt.Sprintf("too large (limit %d bytes)", maxRowBytes), Bytes: len(r.payload)})
	}
	if n := len(r.payload) + len(md) + len(r.topic) + len(key) + len(r.uuid); n > maxRowBytes {
		return r, inbox.Permanent(&UnstorableError{Field: "row", Reason: fmt.Sprintf("too large (limit %d bytes)", maxRowBytes), Bytes: n})
	}
	if !keyrule.Text(r.uuid) {
		r.uuid = key // a UUID that cannot be stored as text: the key names the message
	}
	r.sum = sha256.Sum256(r.payload)
	if r.payload == nil {
		r.payload = []byte{}
	}
	return r, nil
}

// checkText refuses a value PostgreSQL text cannot hold, or longer than limit bytes; "" is
// accepted.
func checkText(field, s string, limit int) error {
	reason := ""
	switch {
	case !utf8.ValidString(s):
		reason = "invalid UTF-8"
	case strings.IndexByte(s, 0) >= 0:
		reason = "contains NUL"
	case len(s) > limit:
		reason = fmt.Sprintf("too long (limit %d bytes)", limit)
	default:
		return nil
	}
	return &UnstorableError{Field: field, Reason: reason, Bytes: len(s)}
}

// sequence reads the producer sequence: a *SequenceError when missing, not a decimal int64, or
// below FirstSequence.
func (i *Inbox) sequence(msg *message.Message) (int64, error) {
	field := i.cfg.SequenceField
	raw, ok := msg.Metadata[field]
	if !ok {
		return 0, &SequenceError{Field: field, Reason: "missing"}
	}
	v, err := strconv.ParseInt(strings.TrimSpace(raw), 10, 64)
	if err != nil {
		return 0, &SequenceError{Field: field, Reason: "not a decimal int64"}
	}
	if v < i.cfg.FirstSequence {
		return 0, &SequenceError{Field: field, Sequence: v, Reason: fmt.Sprintf("below the first sequence %d", i.cfg.FirstSequence)}
	}
	return v, nil
}

// metadata returns the metadata to store as JSON text (broker-side fields removed), or an
// *UnstorableError: a key or value that is not valid UTF-8 or holds NUL (jsonb refuses
// \u0000: SQLSTATE 22P05), or more than jsonb holds.
func (i *Inbox) metadata(msg *message.Message) (string, error) {
	md := make(map[string]string, len(msg.Metadata))
	for k, v := range msg.Metadata {
		if brokerside.IsDeliveryState(k, i.cfg.BrokerSideFields) {
			continue
		}
		if err := checkText("metadata", k, maxMetadataBytes); err != nil {
			return "", err
		}
		if err := checkText("metadata", v, maxMetadataBytes); err != nil {
			return "", err
		}
		md[k] = v
	}
	b, err := json.Marshal(md)
	if err != nil {
		return "", &UnstorableError{Field: "metadata", Reason: "not JSON text", Bytes: len(b)}
	}
	if len(b) > maxMetadataBytes {
		return "", &UnstorableError{Field: "metadata", Reason: fmt.Sprintf("too large (limit %d bytes)", maxMetadataBytes), Bytes: len(b)}
	}
	return string(b), nil
}

// unstorableByPostgres returns the permanent error of an insert PostgreSQL refused for the row
// itself: a data exception (SQLSTATE class 22) or a program limit (class 54); nil otherwise.
func unstorableByPostgres(err error, r receipt) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || len(pgErr.Code) != 5 || (pgErr.Code[:2] != "22" && pgErr.Code[:2] != "54") {
		return nil
	}
	return inbox.Permanent(&UnstorableError{Field: "row", Reason: "refused by PostgreSQL (SQLSTATE " + pgErr.Code + ")",
		Bytes: len(r.payload) + len(r.metadata) + len(r.topic) + len(r.key) + len(r.uuid)})
}
