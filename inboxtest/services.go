package inboxtest

import (
	"os"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/internal/defaults"
)

// DefaultDatabaseURL is used when INBOX_DATABASE_URL is unset.
const DefaultDatabaseURL = defaults.DatabaseURL

// DatabaseURL returns INBOX_DATABASE_URL or DefaultDatabaseURL.
func DatabaseURL() string { return envOr("INBOX_DATABASE_URL", DefaultDatabaseURL) }

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// SkipShort skips t under go test -short, naming the service (e.g. "PostgreSQL") the test
// needs. Every helper of this package that needs a service calls it first; call it yourself
// before reaching a service by other means.
func SkipShort(t testing.TB, service string) {
	t.Helper()
	if testing.Short() {
		t.Skipf("needs %s: skipped under -short (the tier that needs no service)", service)
	}
}
