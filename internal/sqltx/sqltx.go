// Package sqltx carries the inbox's database/sql transaction in a context, with whether it is
// PostgreSQL's, for middleware/sqlstore (which puts it there) and the outbox (which writes in
// it), so that the outbox does not import sqlstore and its MySQL driver.
package sqltx

import (
	"context"
	"database/sql"
)

type key struct{}

type value struct {
	tx       *sql.Tx
	postgres bool
}

// With returns ctx carrying tx; postgres says whether tx is on PostgreSQL.
func With(ctx context.Context, tx *sql.Tx, postgres bool) context.Context {
	return context.WithValue(ctx, key{}, value{tx, postgres})
}

// From returns the transaction ctx carries, whether it is on PostgreSQL, and false when ctx
// carries none.
func From(ctx context.Context) (tx *sql.Tx, postgres, ok bool) {
	v, ok := ctx.Value(key{}).(value)
	return v.tx, v.postgres, ok
}
