package outbox

import (
	"context"
	"errors"

	"github.com/ThreeDotsLabs/watermill"
)

// redactedFields are log fields in which Watermill's components put message contents:
// components/forwarder logs "payload" and "metadata" when it cannot unwrap an envelope, and
// watermill-sql logs the SQL arguments, envelopes included, as "query_args" (trace level).
var redactedFields = map[string]bool{"payload": true, "metadata": true, "query_args": true}

// redactingLogger removes redactedFields from every log line. Payloads and metadata values
// never reach the user's logger through the outbox or the relay.
type redactingLogger struct {
	l watermill.LoggerAdapter
}

// redact wraps l; a nil l discards logs.
func redact(l watermill.LoggerAdapter) watermill.LoggerAdapter {
	if l == nil {
		return watermill.NopLogger{}
	}
	if _, ok := l.(redactingLogger); ok {
		return l
	}
	return redactingLogger{l: l}
}

func clean(fields watermill.LogFields) watermill.LogFields {
	for k := range fields {
		if redactedFields[k] {
			out := make(watermill.LogFields, len(fields))
			for k, v := range fields {
				if redactedFields[k] {
					v = "<redacted>"
				}
				out[k] = v
			}
			return out
		}
	}
	return fields
}

// Error logs at ERROR, except an error caused by a cancelled context: a graceful stop of the
// relay (Close, or the context given to Run) cancels watermill-sql's poll in flight ("could
// not commit tx for querying message: context canceled"), which is harmless (the batch's
// offset was not stored, so it is read again after the restart) and is logged at INFO.
func (r redactingLogger) Error(msg string, err error, fields watermill.LogFields) {
	if errors.Is(err, context.Canceled) {
		r.l.Info(msg+" (stopping)", clean(fields).Add(watermill.LogFields{"error": err.Error()}))
		return
	}
	r.l.Error(msg, err, clean(fields))
}
func (r redactingLogger) Info(msg string, fields watermill.LogFields)  { r.l.Info(msg, clean(fields)) }
func (r redactingLogger) Debug(msg string, fields watermill.LogFields) { r.l.Debug(msg, clean(fields)) }
func (r redactingLogger) Trace(msg string, fields watermill.LogFields) { r.l.Trace(msg, clean(fields)) }
func (r redactingLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return redactingLogger{l: r.l.With(clean(fields))}
}
