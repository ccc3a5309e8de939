// Package dedup is a durable store for Watermill's Deduplicator: an implementation of
// middleware.ExpiringKeyRepository on the inbox table, so that every instance of a consumer
// shares one memory of the keys it saw, across restarts, instead of a map per process.
//
//	repo, err := dedup.New(dedup.Config{Pool: pool, ConsumerName: "billing", Window: time.Hour})
//	d := &middleware.Deduplicator{
//		KeyFactory: func(msg *message.Message) (string, error) { return msg.UUID, nil },
//		Repository: repo,
//		Timeout:    10 * time.Second, // required: see below
//	}
//	router.AddMiddleware(d.Middleware)
//
// Set Timeout. Watermill gives a Deduplicator literal without one a deadline of 5 ms per
// IsDuplicate (only a nil Deduplicator gets a minute), and 5 ms is less than one database
// round trip and commit on a loaded machine, or any wait for a copy's row lock: the delivery
// then fails with "context deadline exceeded".
//
// # What it does not give
//
// It is not the inbox and it is not exactly-once. The Deduplicator asks IsDuplicate before the
// handler runs, and the key is recorded in a transaction of its own, committed at once: nothing
// ties the record to the handler's work.
//
//   - A handler that fails (or a process that crashes in it) after the key was recorded leaves
//     the key behind: the broker's redelivery is then dropped as a duplicate, and the message
//     is lost. At most once for a message whose handler fails, within the window.
//   - A handler's writes are not rolled back with the record, nor the record with them.
//   - After the window a redelivery is processed again.
//
// For exactly-once processing of the handler's database writes, use package middleware/inbox,
// which claims the key in the handler's own transaction. Use this package where dropping
// redeliveries cheaply matters more than never losing one (a cache refresh, a notification
// already sent by another instance).
//
// # The table
//
// The rows are the inbox table's (pgstore's text layout, the default: message_id text,
// consumer_name text, received_at timestamptz; `watermill-inbox migrate` creates it), under a
// consumer name of their own: ConsumerName must not be an inbox consumer's name, or the
// two would take each other's keys for duplicates. The inbox's purge deletes them with the
// inbox's rows once its retention window passes; a window longer than the retention window
// is cut short by the purge. The compact layout (uuid keys, consumer ids) is not supported.
// The role needs SELECT, INSERT, UPDATE on the table (UPDATE beyond what
// `watermill-inbox grants` prints: the record of an expired key is renewed in place).
package dedup

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"strings"
	"text/template"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Defaults of Config: the inbox table's (package middleware/pgstore).
const (
	DefaultSchema = "public"
	DefaultTable  = "inbox_processed_messages"
)

// MaxKeyBytes is the longest key IsDuplicate accepts, as the inbox's keys.
const MaxKeyBytes = 512

// ErrInvalidConfig is wrapped by New's errors for an invalid Config.
var ErrInvalidConfig = errors.New("dedup: invalid configuration")

// ErrInvalidKey is wrapped by IsDuplicate's error for an empty key, one longer than
// MaxKeyBytes, or one that is not UTF-8 or holds a NUL (PostgreSQL text refuses it).
var ErrInvalidKey = errors.New("dedup: invalid key")

//go:embed isduplicate.sql
var isDuplicateSQL string

var isDuplicateTmpl = template.Must(template.New("isduplicate").Parse(isDuplicateSQL))

// Config configures the Repository.
type Config struct {
	// Pool is the database holding the inbox table (required).
	Pool *pgxpool.Pool
	// Schema and Table name the inbox table. Defaults: DefaultSchema, DefaultTable.
	Schema, Table string
	// ConsumerName is the namespace of the keys in the table (required): one per
	// Deduplicator, never an inbox consumer's name.
	ConsumerName string
	// Window is how long a key is remembered (at least a millisecond; required). A key
	// checked again later is new again, and its record is renewed.
	Window time.Duration
}

// Repository implements middleware.ExpiringKeyRepository on the inbox table. It is safe for
// concurrent use, across goroutines and processes.
type Repository struct {
	pool   *pgxpool.Pool
	sql    string
	name   string
	window int64 // microseconds
}

var _ middleware.ExpiringKeyRepository = (*Repository)(nil)

// New returns the Repository, or an error wrapping ErrInvalidConfig for a nil Pool, an empty
// ConsumerName, a Window under a millisecond, or an empty schema or table name after the
// defaults. It does not touch the database.
func New(cfg Config) (*Repository, error) {
	if cfg.Schema == "" {
		cfg.Schema = DefaultSchema
	}
	if cfg.Table == "" {
		cfg.Table = DefaultTable
	}
	switch {
	case cfg.Pool == nil:
		return nil, fmt.Errorf("%w: nil Pool", ErrInvalidConfig)
	case cfg.ConsumerName == "" || !utf8.ValidString(cfg.ConsumerName) || strings.ContainsRune(cfg.ConsumerName, 0):
		return nil, fmt.Errorf("%w: ConsumerName %q", ErrInvalidConfig, cfg.ConsumerName)
	case cfg.Window < time.Millisecond:
		return nil, fmt.Errorf("%w: Window %v, want at least 1ms", ErrInvalidConfig, cfg.Window)
	}
	var b strings.Builder
	if err := isDuplicateTmpl.Execute(&b, struct{ Table string }{pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()}); err != nil {
		return nil, fmt.Errorf("dedup: %w", err)
	}
	return &Repository{pool: cfg.Pool, sql: b.String(), name: cfg.ConsumerName, window: cfg.Window.Microseconds()}, nil
}

// IsDuplicate reports whether key was recorded for the consumer within the window; if not, it
// records it (one statement, committed at once) and returns false. Of concurrent calls with
// one new key, exactly one returns false. Errors: one wrapping ErrInvalidKey, or the
// database's, wrapped (the Deduplicator then fails the delivery: it is nacked, not dropped).
func (r *Repository) IsDuplicate(ctx context.Context, key string) (bool, error) {
	if key == "" || len(key) > MaxKeyBytes || !utf8.ValidString(key) || strings.ContainsRune(key, 0) {
		return false, fmt.Errorf("%w: %d bytes", ErrInvalidKey, len(key))
	}
	var one int
	err := r.pool.QueryRow(ctx, r.sql, key, r.name, r.window).Scan(&one)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return true, nil
	case err != nil:
		return false, fmt.Errorf("dedup: is duplicate: %w", err)
	}
	return false, nil
}
