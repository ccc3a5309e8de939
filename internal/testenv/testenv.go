// Package testenv connects this repository's tests to the real services on the machine:
// PostgreSQL, RabbitMQ, NATS JetStream and Redis. Most of it is a thin layer over the public
// package inboxtest (which package adaptertest uses too, so that adapters outside this
// repository follow the same rules); what stays here is for this repository only: the
// fault-injecting TCP proxy, the router runner and the opt-in for tests that restart a service.
//
// Under go test -short every test that needs a service skips; otherwise a missing service
// fails the test with a hint on how to start it, and never skips (CI=true included).
package testenv

import (
	"context"
	"net"
	"net/url"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/inboxtest"
	"github.com/watermill-inbox/watermill-inbox/internal/defaults"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
)

// DefaultDatabaseURL is used when INBOX_DATABASE_URL is unset (inboxtest.DefaultDatabaseURL).
const DefaultDatabaseURL = inboxtest.DefaultDatabaseURL

// DefaultAMQPURL is used when INBOX_AMQP_URL is unset.
const DefaultAMQPURL = defaults.AMQPURL

// DefaultNATSURL is used when INBOX_NATS_URL is unset.
const DefaultNATSURL = defaults.NATSURL

// DefaultRedisURL is used when INBOX_REDIS_URL is unset.
const DefaultRedisURL = defaults.RedisURL

// DatabaseURL returns INBOX_DATABASE_URL or DefaultDatabaseURL.
func DatabaseURL() string { return inboxtest.DatabaseURL() }

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

// Schema is a fresh PostgreSQL schema for one test, dropped when the test ends
// (inboxtest.Schema, with its Store, Exec and CreateAccounts methods).
type Schema = inboxtest.Schema

// NewSchema is inboxtest.NewSchema: a uniquely named schema and a pool of maxConns
// connections on it, dropped when t ends; it skips t under -short and fails t when
// PostgreSQL is unreachable.
func NewSchema(t testing.TB, maxConns int32) *Schema {
	t.Helper()
	return inboxtest.NewSchema(t, "t", maxConns)
}

// NewPool is inboxtest.NewPool: a pool of maxConns connections on dsn, closed when t ends; it
// skips t under -short and fails t when PostgreSQL is unreachable.
func NewPool(t testing.TB, dsn string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	return inboxtest.NewPool(t, dsn, maxConns)
}

// SkipShort skips t under -short, naming the service it needs (inboxtest.SkipShort).
func SkipShort(t testing.TB, service string) {
	t.Helper()
	inboxtest.SkipShort(t, service)
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
		t.Fatalf("%s URL %q is not a URL with a host", what, redact.URL(raw))
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

// Child is a running child test process (inboxtest.Child).
type Child = inboxtest.Child

// ChildMaxLifetime bounds how long a child started by StartChild may run
// (inboxtest.ChildMaxLifetime).
const ChildMaxLifetime = inboxtest.ChildMaxLifetime

// StartChild re-executes the test binary to run only testName with the extra environment env
// ("KEY=value"), and kills it when t ends (inboxtest.StartChild).
func StartChild(t testing.TB, testName string, env []string) *Child {
	t.Helper()
	return inboxtest.StartChild(t, testName, env)
}

// KilledBySIGKILL reports whether a cmd.Wait error says the process died of SIGKILL
// (inboxtest.KilledBySIGKILL).
func KilledBySIGKILL(err error) bool { return inboxtest.KilledBySIGKILL(err) }

// WaitChildStop is the waiting part of a child's test function: it returns when ctx is done,
// and fails t when the parent is gone or ChildMaxLifetime passed (inboxtest.WaitChildStop).
func WaitChildStop(t testing.TB, ctx context.Context, what string) {
	t.Helper()
	inboxtest.WaitChildStop(t, ctx, what)
}

// WithHost returns dsn with its host:port replaced by hostport (e.g. a Proxy's Addr).
func WithHost(t testing.TB, dsn, hostport string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatalf("parse database URL: %v", err)
	}
	u.Host = hostport
	return u.String()
}

// DatabaseHostPort returns the host:port of DatabaseURL, for a Proxy target.
func DatabaseHostPort(t testing.TB) string {
	t.Helper()
	u, err := url.Parse(DatabaseURL())
	if err != nil || u.Host == "" {
		t.Fatalf("INBOX_DATABASE_URL must be a URL with host:port for this test")
	}
	if u.Port() == "" {
		return net.JoinHostPort(u.Hostname(), "5432")
	}
	return u.Host
}

// EnvRestartServices is the environment variable that lets tests restart the machine's
// PostgreSQL cluster or RabbitMQ node. make test (and so CI) sets it to 1; a plain go test
// ./... leaves it unset, so it never restarts a database someone else is using.
const EnvRestartServices = "INBOX_TEST_RESTART_SERVICES"

// RequireRestartOptIn skips t unless EnvRestartServices is 1 (or another true value of
// strconv.ParseBool), naming the service the test restarts. It also skips under -short.
// Call it first in every test that stops or restarts a shared service.
func RequireRestartOptIn(t testing.TB, service string) {
	t.Helper()
	SkipShort(t, service)
	if !restartOptIn() {
		t.Skipf("restarts the machine's %s: runs only with %s=1 (make test sets it)", service, EnvRestartServices)
	}
}

func restartOptIn() bool {
	on, err := strconv.ParseBool(os.Getenv(EnvRestartServices))
	return err == nil && on
}
