package router

import (
	"strings"
	"testing"
)

// TestCheckEnvRefusesAVariableSetTwice: an environment holding INBOX_BROKER twice (possible
// through execve; Go's os/exec removes duplicates, so it is built here) is refused: libc's
// getenv and Go read the first, a shell the last.
func TestCheckEnvRefusesAVariableSetTwice(t *testing.T) {
	err := checkEnv([]string{"PATH=/bin", "INBOX_BROKER=amqp", "HOME=/", "INBOX_BROKER=nats"})
	if err == nil || !strings.Contains(err.Error(), "INBOX_BROKER is set twice") {
		t.Fatalf("checkEnv with INBOX_BROKER twice: %v", err)
	}
	if err := checkEnv([]string{"INBOX_BROKER=amqp", "INBOX_BROKER_URL=amqp://127.0.0.1:5672/", "INBOX_DATABASE_URL=x", "INBOX_TEST_RECEIVE_ALL=1"}); err != nil {
		t.Fatalf("a plain environment: %v", err)
	}
}
