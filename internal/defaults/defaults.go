// Package defaults holds the local service addresses that package router falls back to and the
// tests connect to when no address is configured: one source of truth for both, and for the
// README, which lists them.
package defaults

const (
	// DatabaseURL is the PostgreSQL database of the tests (INBOX_DATABASE_URL overrides it).
	DatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	// AMQPURL is RabbitMQ's local address with its default guest account (INBOX_AMQP_URL).
	AMQPURL = "amqp://guest:guest@127.0.0.1:5672/"
	// NATSURL is the local NATS server's default address (INBOX_NATS_URL).
	NATSURL = "nats://127.0.0.1:4222"
	// RedisURL is the local Redis server's default address, database 0 (INBOX_REDIS_URL).
	RedisURL = "redis://127.0.0.1:6379/0"
)
