package amqp_test

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
)

// TestURLPasswordNeverPrinted: an AMQP URL with a password and a bad port fails, and neither
// the error nor any log line (trace level) carries the password; the user is kept.
func TestURLPasswordNeverPrinted(t *testing.T) {
	var logs strings.Builder
	_, err := amqp.New(amqp.Config{URL: "amqp://user:secret@127.0.0.1:badport/"}, watermill.NewStdLoggerWithOut(&logs, true, true))
	if err == nil {
		t.Fatal("New with a bad port succeeded")
	}
	if strings.Contains(err.Error(), "secret") || strings.Contains(logs.String(), "secret") {
		t.Fatalf("password printed:\nerror: %v\nlogs:\n%s", err, logs.String())
	}
	if !strings.Contains(err.Error(), "user") {
		t.Fatalf("the error does not name the user: %v", err)
	}
}
