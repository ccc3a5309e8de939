package outbox

import (
	"github.com/ThreeDotsLabs/watermill"

	redactpkg "github.com/watermill-inbox/watermill-inbox/internal/redact"
)

// redact wraps l with the project's redacting logger (internal/redact.Logger): the fields in
// which Watermill's components put message contents ("payload", "metadata", watermill-sql's
// "query_args") are replaced by "<redacted>", string values with control characters are
// quoted, and a graceful stop's cancelled poll ("could not commit tx for querying message:
// context canceled") is logged at INFO, not ERROR. A nil l discards logs.
func redact(l watermill.LoggerAdapter) watermill.LoggerAdapter {
	return redactpkg.Logger(l)
}
