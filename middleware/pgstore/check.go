package pgstore

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/migrate"
)

// SchemaError is CheckSchema's answer when the schema needs migrating: the tables that do not
// exist and the migrations not recorded as applied. Run Migrate (or the script of
// MigrationSQL) as a role that may create tables, then check again.
type SchemaError struct {
	// Table is the quoted inbox table checked, e.g. "public"."inbox_processed_messages".
	Table string
	// Missing lists the quoted tables that do not exist (or that the role cannot see).
	Missing []string
	// Pending lists the migrations not recorded as applied, by file name, e.g.
	// "0002_create_attempts.sql".
	Pending []string
}

func (e *SchemaError) Error() string {
	return migrate.Describe("pgstore", e.Table, e.Missing, e.Pending,
		"run Migrate or `watermill-inbox migrate` as the schema's owner")
}

// Unwrap returns ErrSchemaNotCurrent.
func (e *SchemaError) Unwrap() error { return ErrSchemaNotCurrent }

// CheckSchema reports whether the inbox schema is current, reading only (no DDL, no lock):
// nil when the inbox table, the attempts table and the version table exist and every
// migration is recorded as applied; a *SchemaError (wrapping ErrSchemaNotCurrent) naming
// what is missing or pending; or the database's error, wrapped. It needs only what the
// application role has (USAGE on the schema, SELECT on the version table; see Grants), so it
// serves as a readiness probe and as the start-up check of a role that cannot create tables.
func (s *Store) CheckSchema(ctx context.Context) error {
	st, err := s.migrations().Check(ctx, s.pool)
	if err != nil {
		return err
	}
	if st.Current() {
		return nil
	}
	return &SchemaError{Table: s.table, Missing: st.Missing, Pending: st.PendingNames()}
}

// Querier is what the store's catalog reads run on (DetectLayout, CheckConversion):
// *pgxpool.Pool, *pgxpool.Conn, *pgx.Conn or a pgx.Tx.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}
