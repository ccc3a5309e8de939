package outbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Metadata keys the relay's schema adapter sets on the outbox row's own message (never on the
// message it publishes: components/forwarder builds that one from the envelope alone).
const (
	rowOffsetKey    = "_outbox_row_offset"
	rowTxKey        = "_outbox_row_transaction_id"
	rowMalformedKey = "_outbox_row_malformed"
)

// MalformedRow describes an outbox row the relay could not read as a forwarder envelope, for
// RelayConfig.OnMalformedRow. It carries no payload or metadata value.
type MalformedRow struct {
	// Offset is the row's "offset" column (the BIGSERIAL of the outbox table).
	Offset int64
	// TransactionID is the row's transaction_id column (xid8); 0 on MySQL, whose outbox table
	// has none.
	TransactionID uint64
	// UUID is the row's uuid column (the envelope's UUID), as stored.
	UUID string
	// Reason says what is wrong, e.g. "metadata column is not a JSON object of strings".
	Reason string
	// Skipped is true when the relay acknowledged the row without publishing anything (a
	// metadata column it cannot read, always; an invalid envelope with AckWhenCannotUnwrap),
	// false when it refuses to pass it (an invalid envelope without AckWhenCannotUnwrap: the
	// consumer group stops at the row, which is reported again at every retry).
	Skipped bool
}

// relaySchema is watermill-sql's PostgreSQL schema with an UnmarshalMessage that never fails
// on a row's contents: watermill-sql v4.1.2 fails the whole poll on a metadata column that is
// not a JSON object of strings (a JSON array, a number in the map), so one such row, written
// by anything with INSERT on the table, would stop every later row forever. The row is handed
// on marked malformed instead, and the relay's first middleware skips and reports it with its
// offset. Every row also carries its offset and transaction id, for reports.
type relaySchema struct {
	wmsql.DefaultPostgreSQLSchema
}

func (s relaySchema) UnmarshalMessage(params wmsql.UnmarshalMessageParams) (wmsql.Row, error) {
	r := wmsql.Row{}
	var txID wmsql.XID8
	if err := params.Row.Scan(&r.Offset, &txID, &r.UUID, &r.Payload, &r.Metadata); err != nil {
		return wmsql.Row{}, fmt.Errorf("could not scan message row: %w", err)
	}
	r.Msg = rowMessage(r, uint64(txID))
	r.ExtraData = map[string]any{"transaction_id": txID}
	return r, nil
}

// mysqlRelaySchema is relaySchema's counterpart on watermill-sql's MySQL queue schema, whose
// rows have no transaction id (reported as 0): watermill-sql v4.1.2's MySQL UnmarshalMessage
// fails the whole poll on an unreadable metadata column too.
type mysqlRelaySchema struct {
	wmsql.MySQLQueueSchema
}

func (s mysqlRelaySchema) UnmarshalMessage(params wmsql.UnmarshalMessageParams) (wmsql.Row, error) {
	r := wmsql.Row{}
	if err := params.Row.Scan(&r.Offset, &r.UUID, &r.Payload, &r.Metadata); err != nil {
		return wmsql.Row{}, fmt.Errorf("could not scan message row: %w", err)
	}
	r.Msg = rowMessage(r, 0)
	return r, nil
}

// rowMessage is the message of an outbox row as read (payload: the envelope), its metadata
// the row's JSON object, or the malformed mark when the column is not a JSON object of
// strings, with the row's offset and transaction id added.
func rowMessage(r wmsql.Row, txID uint64) *message.Message {
	msg := message.NewMessage(string(r.UUID), r.Payload)
	var md message.Metadata
	if len(r.Metadata) > 0 {
		if err := json.Unmarshal(r.Metadata, &md); err != nil {
			md = message.Metadata{rowMalformedKey: "metadata column is not a JSON object of strings"}
		}
	}
	if md == nil {
		md = message.Metadata{}
	}
	md[rowOffsetKey] = strconv.FormatInt(r.Offset, 10)
	md[rowTxKey] = strconv.FormatUint(txID, 10)
	msg.Metadata = md
	return msg
}

// envelopeShape is components/forwarder's envelope as its unwrapping decodes it.
type envelopeShape struct {
	DestinationTopic string            `json:"destination_topic"`
	UUID             string            `json:"uuid"`
	Payload          []byte            `json:"payload"`
	Metadata         map[string]string `json:"metadata"`
}

// checkEnvelope returns why payload is not an envelope the forwarder can unwrap, or "".
func checkEnvelope(payload []byte) string {
	var e envelopeShape
	if err := json.Unmarshal(payload, &e); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) {
			return "payload is not a forwarder envelope: field " + strconv.Quote(typeErr.Field) + " has the wrong JSON type"
		}
		return "payload is not a forwarder envelope (invalid JSON)"
	}
	if e.DestinationTopic == "" {
		return "payload is not a forwarder envelope: no destination_topic"
	}
	return ""
}

// errMalformedRow is returned (wrapped) for a row with an invalid envelope when
// AckWhenCannotUnwrap is false: the subscriber hands the row again after ResendInterval.
var errMalformedRow = errors.New("outbox relay: row is not a forwarder envelope")

// malformedRows is the relay's outermost middleware: it skips and reports rows whose
// metadata column watermill-sql could not read, and reports (and, with AckWhenCannotUnwrap,
// skips) rows whose payload is not a forwarder envelope, always naming the row's offset.
func (r *Relay) malformedRows(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		reason := msg.Metadata.Get(rowMalformedKey)
		skip := true
		if reason == "" {
			reason = checkEnvelope(msg.Payload)
			skip = r.cfg.AckWhenCannotUnwrap
		}
		if reason == "" {
			return h(msg)
		}
		offset, _ := strconv.ParseInt(msg.Metadata.Get(rowOffsetKey), 10, 64)
		txID, _ := strconv.ParseUint(msg.Metadata.Get(rowTxKey), 10, 64)
		row := MalformedRow{Offset: offset, TransactionID: txID, UUID: msg.UUID, Reason: reason, Skipped: skip}
		fields := watermill.LogFields{"row_offset": offset, "row_transaction_id": txID, "row_uuid": quoteForLog(msg.UUID), "reason": reason}
		if skip {
			r.stats.malformed.Add(1)
			if tx, ok := wmsql.TxFromContext(msg.Context()); ok {
				if rtx, ok := tx.(*relayTx); ok {
					rtx.mu.Lock()
					rtx.skipped++
					rtx.mu.Unlock()
				}
			}
			r.logger.Error("Outbox relay skipped a row it cannot read (acknowledged, nothing published)", errMalformedRow, fields)
		} else {
			r.logger.Error("Outbox relay stops at a row it cannot unwrap (AckWhenCannotUnwrap is false); fix or delete the row", errMalformedRow, fields)
		}
		if r.cfg.OnMalformedRow != nil {
			r.cfg.OnMalformedRow(row)
		}
		if skip {
			return nil, nil
		}
		return nil, fmt.Errorf("%w at offset %d: %s", errMalformedRow, offset, reason)
	}
}

// quoteForLog quotes s when it holds anything but printable ASCII, so a row's uuid cannot
// forge log lines.
func quoteForLog(s string) string {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return strconv.Quote(s)
		}
	}
	return s
}
