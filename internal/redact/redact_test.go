package redact_test

import (
	"errors"
	"net/url"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-inbox/watermill-inbox/internal/redact"
)

// TestURLKeepsTheUserAndMasksThePassword: every URL form the project prints (AMQP, NATS,
// Redis, PostgreSQL, an SQS endpoint, a Kafka seed broker without a scheme, an unparseable
// one with a bad port) loses its password and keeps its user.
func TestURLKeepsTheUserAndMasksThePassword(t *testing.T) {
	for _, raw := range []string{
		"amqp://user:secret@127.0.0.1:5672/",
		"amqp://user:secret@127.0.0.1:badport/",
		"nats://user:secret@127.0.0.1:4222",
		"redis://user:secret@127.0.0.1:6379/0",
		"postgres://user:secret@127.0.0.1:5432/app",
		"http://user:secret@127.0.0.1:4100",
		"user:secret@k1:9092",
		"user:secret@k1:badport",
	} {
		got := redact.URL(raw)
		if strings.Contains(got, "secret") {
			t.Errorf("URL(%q) = %q: the password is printed", raw, got)
		}
		if _, err := url.Parse(raw); err == nil && !strings.Contains(got, "user") {
			t.Errorf("URL(%q) = %q: the user is lost", raw, got)
		}
	}
	if got := redact.URL("nats://127.0.0.1:4222"); got != "nats://127.0.0.1:4222" {
		t.Errorf("a URL without a password changed: %q", got)
	}
}

// TestErrMasksAndStillWraps: an error echoing a URL loses the password, and errors.Is still
// finds what it wrapped.
func TestErrMasksAndStillWraps(t *testing.T) {
	base := errors.New("root cause")
	raw := "amqp://user:secret@127.0.0.1:badport/"
	_, perr := url.Parse(raw)
	err := redact.Err(errors.Join(perr, base), raw)
	if strings.Contains(err.Error(), "secret") {
		t.Fatalf("password in %q", err)
	}
	if !errors.Is(err, base) {
		t.Fatal("the redacted error no longer wraps its cause")
	}
}

// TestLoggerRedacts: at trace level, payload fields, a URL's password and a forged line
// (control characters in a field value) never reach the output.
func TestLoggerRedacts(t *testing.T) {
	var buf strings.Builder
	raw := "redis://user:secret@127.0.0.1:6379/0"
	l := redact.Logger(watermill.NewStdLoggerWithOut(&buf, true, true), raw)
	l.Trace("query", watermill.LogFields{"query_args": "[MARKER-PAYLOAD]", "payload": "MARKER-PAYLOAD", "metadata": "MARKER-PAYLOAD"})
	l.Info("connecting to "+raw, watermill.LogFields{"url": raw, "key": "k\nlevel=ERROR msg=forged"})
	l.Error("failed", errors.New("dial "+raw), watermill.LogFields{"err": errors.New(raw)})
	l.With(watermill.LogFields{"payload": "MARKER-PAYLOAD"}).Debug("with", nil)
	out := buf.String()
	for _, bad := range []string{"MARKER-PAYLOAD", "secret"} {
		if strings.Contains(out, bad) {
			t.Errorf("%q logged:\n%s", bad, out)
		}
	}
	if n := strings.Count(out, "\n"); n != 4 {
		t.Errorf("%d lines for 4 log calls (a forged line?):\n%s", n, out)
	}
}
