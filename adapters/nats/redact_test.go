package nats_test

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-inbox/watermill-inbox/adapters/nats"
)

// TestURLPasswordNeverPrinted: a NATS URL list with a password and a bad port fails, and
// neither the error nor any log line (trace level) carries the password; the user is kept.
func TestURLPasswordNeverPrinted(t *testing.T) {
	for _, u := range []string{"nats://user:secret@127.0.0.1:badport", "nats://127.0.0.1:4222,nats://user:secret@127.0.0.1:badport"} {
		var logs strings.Builder
		_, err := nats.New(nats.Config{URL: u, ConsumerGroup: "g"}, watermill.NewStdLoggerWithOut(&logs, true, true))
		if err == nil {
			t.Fatalf("New(%s) with a bad port succeeded", u)
		}
		if strings.Contains(err.Error(), "secret") || strings.Contains(logs.String(), "secret") {
			t.Fatalf("password printed:\nerror: %v\nlogs:\n%s", err, logs.String())
		}
		if !strings.Contains(err.Error(), "user") {
			t.Fatalf("the error does not name the user: %v", err)
		}
	}
}
