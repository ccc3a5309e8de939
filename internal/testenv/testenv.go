// Package testenv connects tests to the real services on the machine: PostgreSQL, RabbitMQ,
// NATS JetStream and Redis.
// A missing service fails the test with a hint on how to start it; it never skips.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/defaults"
)

// DefaultDatabaseURL is used when INBOX_DATABASE_URL is unset.
const DefaultDatabaseURL = defaults.DatabaseURL

// DefaultAMQPURL is used when INBOX_AMQP_URL is unset.
const DefaultAMQPURL = defaults.AMQPURL

// DatabaseURL returns INBOX_DATABASE_URL or DefaultDatabaseURL.
func DatabaseURL() string {
	if v := os.Getenv("INBOX_DATABASE_URL"); v != "" {
		return v
	}
	return DefaultDatabaseURL
}

// AMQPURL returns INBOX_AMQP_URL or DefaultAMQPURL.
func AMQPURL() string {
	if v := os.Getenv("INBOX_AMQP_URL"); v != "" {
		return v
	}
	return DefaultAMQPURL
}

// Schema is a fresh PostgreSQL schema for one test, dropped when the test ends.
type Schema struct {
	// Name is the unquoted schema name, e.g. "t_3f9a1c2b7e".
	Name string
	// URL is DatabaseURL with search_path set to Name, for child processes.
	URL string
	// Pool connects with search_path = Name.
	Pool *pgxpool.Pool
}

// NewSchema creates a uniquely named schema, returns a pool of maxConns connections whose
// search_path is that schema, and drops the schema (CASCADE) when t ends. It fails t when
// PostgreSQL is unreachable.
func NewSchema(t testing.TB, maxConns int32) *Schema {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, DatabaseURL())
	if err != nil {
		t.Fatalf("PostgreSQL is not reachable at INBOX_DATABASE_URL=%q: %v\nif it is down, start it with: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start; if the database or role is missing, see the README's quick start", redact(DatabaseURL()), err)
	}
	defer admin.Close(context.Background())
	var b [5]byte
	_, _ = rand.Read(b[:])
	name := "t_" + hex.EncodeToString(b[:])
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	u, err := url.Parse(DatabaseURL())
	if err != nil {
		t.Fatalf("parse INBOX_DATABASE_URL: %v", err)
	}
	q := u.Query()
	q.Set("search_path", name)
	u.RawQuery = q.Encode()
	s := &Schema{Name: name, URL: u.String()}
	s.Pool = NewPool(t, s.URL, maxConns)
	t.Cleanup(func() {
		s.Pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, DatabaseURL())
		if err != nil {
			t.Errorf("drop schema %s: %v", name, err)
			return
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", name, err)
		}
	})
	return s
}

// NewPool opens a pool of maxConns connections on dsn and closes it when t ends.
func NewPool(t testing.TB, dsn string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatalf("parse database URL: %v", err)
	}
	cfg.MaxConns = maxConns
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		t.Fatalf("PostgreSQL is not reachable at %q: %v", redact(dsn), err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// RequireAMQP fails t when RabbitMQ does not accept TCP connections at AMQPURL.
func RequireAMQP(t testing.TB) string {
	t.Helper()
	u, err := url.Parse(AMQPURL())
	if err != nil {
		t.Fatalf("parse INBOX_AMQP_URL: %v", err)
	}
	c, err := net.DialTimeout("tcp", u.Host, 5*time.Second)
	if err != nil {
		t.Fatalf("RabbitMQ is not reachable at %s: %v\nstart it with: rabbitmq-server -detached", u.Host, err)
	}
	_ = c.Close()
	return AMQPURL()
}

// DefaultNATSURL is used when INBOX_NATS_URL is unset.
const DefaultNATSURL = defaults.NATSURL

// DefaultRedisURL is used when INBOX_REDIS_URL is unset.
const DefaultRedisURL = defaults.RedisURL

// NATSURL returns INBOX_NATS_URL or DefaultNATSURL.
func NATSURL() string {
	if v := os.Getenv("INBOX_NATS_URL"); v != "" {
		return v
	}
	return DefaultNATSURL
}

// RedisURL returns INBOX_REDIS_URL or DefaultRedisURL.
func RedisURL() string {
	if v := os.Getenv("INBOX_REDIS_URL"); v != "" {
		return v
	}
	return DefaultRedisURL
}

// RequireNATS fails t when the NATS server does not accept TCP connections at NATSURL.
// Whether JetStream is on is checked by the adapter, which fails to connect without it.
func RequireNATS(t testing.TB) string {
	t.Helper()
	requireTCP(t, "NATS", NATSURL(), "4222",
		"start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log")
	return NATSURL()
}

// RequireRedis fails t when Redis does not accept TCP connections at RedisURL.
func RequireRedis(t testing.TB) string {
	t.Helper()
	requireTCP(t, "Redis", RedisURL(), "6379",
		`redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log`)
	return RedisURL()
}

func requireTCP(t testing.TB, what, raw, defaultPort, start string) {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil || u.Hostname() == "" {
		t.Fatalf("%s URL %q is not a URL with a host", what, redact(raw))
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), defaultPort)
	}
	c, err := net.DialTimeout("tcp", host, 5*time.Second)
	if err != nil {
		t.Fatalf("%s is not reachable at %s: %v\nstart it with: %s", what, host, err, start)
	}
	_ = c.Close()
}

// redact removes the password from a URL for error messages.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparseable URL>"
	}
	return u.Redacted()
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
