package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// ErrSchemaMissing is returned (wrapped, naming the tables) by CheckSchema when an outbox
// table does not exist, or the role cannot see it.
var ErrSchemaMissing = errors.New("outbox: tables missing")

// CheckSchema reports whether the outbox tables of cfg exist, reading only (no DDL, no lock,
// no privilege beyond USAGE on the schema): nil, an error wrapping ErrSchemaMissing that
// names the missing tables, an error wrapping inbox.ErrInvalidConfig for an invalid cfg, or
// the database's error, wrapped. Use it in readiness probes and at the start-up of a role
// that cannot create tables.
func CheckSchema(ctx context.Context, pool *pgxpool.Pool, cfg Config) error {
	if pool == nil {
		return fmt.Errorf("%w: outbox: nil pool", inbox.ErrInvalidConfig)
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return err
	}
	var messages, offsets bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL",
		cfg.MessagesTable(), cfg.OffsetsTable()).Scan(&messages, &offsets); err != nil {
		return fmt.Errorf("outbox: check schema: %w", err)
	}
	var missing []string
	if !messages {
		missing = append(missing, cfg.MessagesTable())
	}
	if !offsets {
		missing = append(missing, cfg.OffsetsTable())
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: %s (run InitializeSchema or `watermill-inbox migrate --outbox` as the schema's owner)", ErrSchemaMissing, strings.Join(missing, ", "))
	}
	return nil
}
