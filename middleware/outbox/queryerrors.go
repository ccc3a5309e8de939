package outbox

import (
	"context"
	stdsql "database/sql"
	"errors"

	"github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5/pgconn"
)

// queryErrorLogger wraps the relay subscriber's database handle to log the errors that
// watermill-sql v4.1.2 drops: its Rows interface has no Err method, so an error that PostgreSQL
// raises while the SELECT of a poll executes (pgx reports those through Rows.Err, not from
// Query) ends the row loop silently and the poll looks empty. It changes no behaviour: the
// subscriber still treats the poll as empty, commits nothing of it and polls again.
//
// SQLSTATE 40001 is logged at debug level only: under the subscriber's REPEATABLE READ, a
// relay that waited on its consumer group's offset row while another relay of the group
// advanced it fails that way, which is the expected hand-over between relays.
type queryErrorLogger struct {
	wmsql.Beginner
	logger watermill.LoggerAdapter
}

func (b queryErrorLogger) BeginTx(ctx context.Context, opts *stdsql.TxOptions) (wmsql.Tx, error) {
	tx, err := b.Beginner.BeginTx(ctx, opts)
	if err != nil {
		return tx, err
	}
	return queryErrorTx{Tx: tx, logger: b.logger}, nil
}

func (b queryErrorLogger) QueryContext(ctx context.Context, query string, args ...any) (wmsql.Rows, error) {
	rows, err := b.Beginner.QueryContext(ctx, query, args...)
	if err != nil {
		return rows, err
	}
	return queryErrorRows{Rows: rows, logger: b.logger}, nil
}

type queryErrorTx struct {
	wmsql.Tx
	logger watermill.LoggerAdapter
}

func (t queryErrorTx) QueryContext(ctx context.Context, query string, args ...any) (wmsql.Rows, error) {
	rows, err := t.Tx.QueryContext(ctx, query, args...)
	if err != nil {
		return rows, err
	}
	return queryErrorRows{Rows: rows, logger: t.logger}, nil
}

type queryErrorRows struct {
	wmsql.Rows
	logger watermill.LoggerAdapter
}

func (r queryErrorRows) Close() error {
	cerr := r.Rows.Close()
	withErr, ok := r.Rows.(interface{ Err() error })
	if !ok {
		return cerr
	}
	err := withErr.Err()
	var pgErr *pgconn.PgError
	switch {
	case err == nil, errors.Is(err, context.Canceled):
	case errors.As(err, &pgErr) && pgErr.Code == "40001":
		r.logger.Debug("Outbox poll lost the consumer group's offset row to another relay; polling again", nil)
	default:
		r.logger.Error("Outbox poll failed while reading rows; watermill-sql treats it as an empty poll and polls again", err, nil)
	}
	return cerr
}
