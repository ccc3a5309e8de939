package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
)

// TestGracefulStopIsNotAnError: the error watermill-sql logs when a stop cancels its poll
// (a wrapped context.Canceled) reaches the user's logger at INFO, other errors at ERROR, and
// payload fields stay redacted either way.
func TestGracefulStopIsNotAnError(t *testing.T) {
	var buf strings.Builder
	l := redact(watermill.NewStdLoggerWithOut(&buf, true, true))
	l.Error("could not commit tx for querying message", fmt.Errorf("commit: %w", context.Canceled), watermill.LogFields{"query_args": "secret-payload"})
	l.Error("could not publish", errors.New("broker down"), nil)
	out := buf.String()
	if strings.Contains(out, "secret-payload") {
		t.Fatalf("payload logged:\n%s", out)
	}
	for _, line := range strings.Split(out, "\n") {
		switch {
		case strings.Contains(line, "could not commit tx") && !strings.Contains(line, "level=INFO"):
			t.Fatalf("a graceful stop logged above INFO: %s", line)
		case strings.Contains(line, "could not publish") && !strings.Contains(line, "level=ERROR"):
			t.Fatalf("a real error logged below ERROR: %s", line)
		}
	}
}
