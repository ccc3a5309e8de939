// Package keyrule is the one place of the rules for what the inbox stores beside a message:
// a message key, optional text (a message type, a correlation ID), a message ID in logs, a
// UUIDv7's time. Package inbox exposes the key rule as ValidateKey; the other modes
// (middleware/deferred) and the stores call these directly.
package keyrule

import (
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
)

// MaxKeyBytes is the longest message key accepted, in bytes (UTF-8): far below PostgreSQL's
// B-tree entry limit of about 2,700 bytes (a third of an 8 KiB page), beyond which an INSERT
// fails with SQLSTATE 54000.
const MaxKeyBytes = 512

// MaxConsumerNameBytes is the longest consumer name accepted, in bytes (UTF-8).
const MaxConsumerNameBytes = 128

// Problem returns why key cannot be a message key ("empty", "blank", "too long (limit N
// bytes)", "invalid UTF-8", "contains NUL": PostgreSQL text cannot hold NUL, SQLSTATE
// 22021), or "" when it can.
func Problem(key string) string {
	switch {
	case key == "":
		return "empty"
	case strings.TrimSpace(key) == "":
		return "blank"
	case len(key) > MaxKeyBytes:
		return fmt.Sprintf("too long (limit %d bytes)", MaxKeyBytes)
	case !utf8.ValidString(key):
		return "invalid UTF-8"
	case strings.IndexByte(key, 0) >= 0:
		return "contains NUL"
	}
	return ""
}

// Text reports whether s may be stored as optional text beside a message (a message type, a
// correlation ID, an aggregate key): what a key may be.
func Text(s string) bool { return Problem(s) == "" }

// SafeID returns a message UUID or key as it may appear in logs and error strings: a
// placeholder naming its length when it is not key material (invalid UTF-8, NUL, oversized),
// quoted with Go escapes when it holds a control character (which could forge log lines),
// else unchanged.
func SafeID(id string) string {
	if Problem(id) != "" {
		return fmt.Sprintf("<invalid, %d bytes>", len(id))
	}
	if strings.IndexFunc(id, unicode.IsControl) >= 0 {
		return strconv.Quote(id)
	}
	return id
}

// UUIDv7Time returns the Unix-millisecond timestamp embedded in a UUIDv7 given in its
// canonical 36-character 8-4-4-4-12 form, hex digits in either case (RFC 9562, section 5.7:
// the first 48 bits are the Unix time in milliseconds, the version nibble is 7, the variant
// bits are 10), and false for any other string: another version or variant, another length
// or form (braces, urn:uuid:, no hyphens), a non-hex digit. It is the one UUIDv7 reader of
// the module: inbox.ProducerTimeFromUUIDv7 and pgstore's ProducerTimeFromKey call it.
func UUIDv7Time(id string) (time.Time, bool) {
	if len(id) != 36 {
		return time.Time{}, false
	}
	u, err := uuid.Parse(id)
	if err != nil || u.Version() != 7 || u.Variant() != uuid.RFC4122 {
		return time.Time{}, false
	}
	var ms int64
	for _, b := range u[:6] {
		ms = ms<<8 | int64(b)
	}
	return time.UnixMilli(ms), true
}
