package redis_test

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-inbox/watermill-inbox/adapters/redis"
)

// TestURLPasswordNeverPrinted: a Redis URL with a password and a bad port, or an unreachable
// one, fails, and neither the error nor any log line (trace level) carries the password.
func TestURLPasswordNeverPrinted(t *testing.T) {
	for _, u := range []string{"redis://user:secret@127.0.0.1:badport/0", "redis://user:secret@127.0.0.1:1/0"} {
		var logs strings.Builder
		_, err := redis.New(redis.Config{URL: u, ConsumerGroup: "g"}, watermill.NewStdLoggerWithOut(&logs, true, true))
		if err == nil {
			t.Fatalf("New(%s) succeeded", u)
		}
		if strings.Contains(err.Error(), "secret") || strings.Contains(logs.String(), "secret") {
			t.Fatalf("password printed:\nerror: %v\nlogs:\n%s", err, logs.String())
		}
		if !strings.Contains(err.Error(), "user") {
			t.Fatalf("the error does not name the user: %v", err)
		}
	}
}
