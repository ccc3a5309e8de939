// Package pgtx carries the inbox's pgx transaction in a context, for the modes that open it
// (pgstore's claim, the store-then-process workers) and for pgstore.TxFromContext, which
// hands it to handlers.
package pgtx

import (
	"context"

	"github.com/jackc/pgx/v5"
)

type key struct{}

// With returns ctx carrying tx.
func With(ctx context.Context, tx pgx.Tx) context.Context { return context.WithValue(ctx, key{}, tx) }

// From returns the transaction ctx carries, and false when none.
func From(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(key{}).(pgx.Tx)
	return tx, ok
}
