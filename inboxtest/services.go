package inboxtest

import (
	"net"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/defaults"
)

// DefaultDatabaseURL is used when INBOX_DATABASE_URL is unset.
const DefaultDatabaseURL = defaults.DatabaseURL

// DefaultAMQPURL is used when INBOX_AMQP_URL is unset.
const DefaultAMQPURL = defaults.AMQPURL

// DefaultNATSURL is used when INBOX_NATS_URL is unset.
const DefaultNATSURL = defaults.NATSURL

// DefaultRedisURL is used when INBOX_REDIS_URL is unset.
const DefaultRedisURL = defaults.RedisURL

// DatabaseURL returns INBOX_DATABASE_URL or DefaultDatabaseURL.
func DatabaseURL() string { return envOr("INBOX_DATABASE_URL", DefaultDatabaseURL) }

// AMQPURL returns INBOX_AMQP_URL or DefaultAMQPURL.
func AMQPURL() string { return envOr("INBOX_AMQP_URL", DefaultAMQPURL) }

// NATSURL returns INBOX_NATS_URL or DefaultNATSURL.
func NATSURL() string { return envOr("INBOX_NATS_URL", DefaultNATSURL) }

// RedisURL returns INBOX_REDIS_URL or DefaultRedisURL.
func RedisURL() string { return envOr("INBOX_REDIS_URL", DefaultRedisURL) }

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

// RequireAMQP returns AMQPURL. It skips t under -short, and fails t when RabbitMQ does not
// accept TCP connections at AMQPURL within 5 s.
func RequireAMQP(t testing.TB) string {
	t.Helper()
	SkipShort(t, "RabbitMQ")
	requireTCP(t, "RabbitMQ", AMQPURL(), "5672", "rabbitmq-server -detached")
	return AMQPURL()
}

// RequireNATS returns NATSURL. It skips t under -short, and fails t when the NATS server does
// not accept TCP connections at NATSURL within 5 s. Whether JetStream is on is checked by the
// adapter, which fails to connect without it.
func RequireNATS(t testing.TB) string {
	t.Helper()
	SkipShort(t, "NATS")
	requireTCP(t, "NATS", NATSURL(), "4222",
		"nats-server -a 127.0.0.1 -p 4222 -js (JetStream on), e.g. make services")
	return NATSURL()
}

// RequireRedis returns RedisURL. It skips t under -short, and fails t when Redis does not
// accept TCP connections at RedisURL within 5 s.
func RequireRedis(t testing.TB) string {
	t.Helper()
	SkipShort(t, "Redis")
	requireTCP(t, "Redis", RedisURL(), "6379",
		`redis-server --port 6379 --save "" --appendonly no, e.g. make services`)
	return RedisURL()
}

// requireTCP fails t unless raw's host (with defaultPort when it names none) accepts a TCP
// connection; start is the hint printed on how to start the service.
func requireTCP(t testing.TB, what, raw, defaultPort, start string) {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil || u.Hostname() == "" {
		t.Fatalf("%s URL %q is not a URL with a host", what, Redact(raw))
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), defaultPort)
	}
	c, err := net.DialTimeout("tcp", host, 5*time.Second)
	if err != nil {
		t.Fatalf("%s is not reachable at %s: %v\nstart it with: %s\n(go test -short runs only the tests that need no service)", what, host, err, start)
	}
	_ = c.Close()
}

// Redact returns raw with its password removed, for messages; "<unparseable URL>" when raw
// does not parse.
func Redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparseable URL>"
	}
	return u.Redacted()
}
