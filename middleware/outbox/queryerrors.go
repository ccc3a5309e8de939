package outbox

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// relayDB is the database handle the relay's watermill-sql subscriber reads the outbox with: a
// pgx pool, like watermill-sql's own BeginnerFromPgx, with three differences.
//
//   - Errors that watermill-sql v4.1.2 drops are logged: its Rows interface has no Err method,
//     so an error PostgreSQL raises while the SELECT of a poll executes (pgx reports those
//     through Rows.Err, not from Query) ends the row loop silently and the poll looks empty.
//     SQLSTATE 40001 is logged at debug level only: under the subscriber's REPEATABLE READ, a
//     relay that waited on its consumer group's offset row while another relay of the group
//     advanced it fails that way, which is the expected hand-over between relays.
//   - Statements after the SELECT (the offset update) and COMMIT run on a context detached
//     from the subscription's, bounded by the relay's CloseTimeout: a graceful stop (Close,
//     or Run's context ending) lets the batch in flight store the offset of what it already
//     published, instead of failing its COMMIT and publishing all of it again after the
//     restart.
//   - COMMIT first waits for the batch's pipelined publishes (see relayTx.Commit).
type relayDB struct {
	pool  *pgxpool.Pool
	relay *Relay
}

func (d relayDB) BeginTx(ctx context.Context, opts *stdsql.TxOptions) (wmsql.Tx, error) {
	txOpts := pgx.TxOptions{}
	if opts != nil {
		switch opts.Isolation {
		case stdsql.LevelReadCommitted:
			txOpts.IsoLevel = pgx.ReadCommitted
		case stdsql.LevelRepeatableRead:
			txOpts.IsoLevel = pgx.RepeatableRead
		case stdsql.LevelSerializable:
			txOpts.IsoLevel = pgx.Serializable
		}
	}
	tx, err := d.pool.BeginTx(ctx, txOpts)
	if err != nil {
		return nil, err
	}
	return &relayTx{tx: pgxPollTx{tx: tx, logger: d.relay.logger}, relay: d.relay, started: time.Now()}, nil
}

// pollTx is the transaction of one relay poll: pgx's (pgxPollTx) or database/sql's on MySQL
// (sqlPollTx). Rows it returns log the errors watermill-sql would drop.
type pollTx interface {
	exec(ctx context.Context, query string, args ...any) (wmsql.Result, error)
	query(ctx context.Context, query string, args ...any) (wmsql.Rows, error)
	commit(ctx context.Context) error
	rollback(ctx context.Context) error
}

type pgxPollTx struct {
	tx     pgx.Tx
	logger watermill.LoggerAdapter
}

func (t pgxPollTx) exec(ctx context.Context, query string, args ...any) (wmsql.Result, error) {
	tag, err := t.tx.Exec(ctx, query, args...)
	return result{tag}, err
}

func (t pgxPollTx) query(ctx context.Context, query string, args ...any) (wmsql.Rows, error) {
	rows, err := t.tx.Query(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return relayRows{rows: rows, logger: t.logger}, nil
}

func (t pgxPollTx) commit(ctx context.Context) error   { return t.tx.Commit(ctx) }
func (t pgxPollTx) rollback(ctx context.Context) error { return t.tx.Rollback(ctx) }

func (d relayDB) ExecContext(ctx context.Context, query string, args ...any) (wmsql.Result, error) {
	tag, err := d.pool.Exec(ctx, query, args...)
	return result{tag}, err
}

func (d relayDB) QueryContext(ctx context.Context, query string, args ...any) (wmsql.Rows, error) {
	rows, err := d.pool.Query(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return relayRows{rows: rows, logger: d.relay.logger}, nil
}

type result struct{ pgconn.CommandTag }

func (r result) RowsAffected() (int64, error) { return r.CommandTag.RowsAffected(), nil }

// detached returns a context that outlives ctx's cancellation, bounded by the relay's
// CloseTimeout, for the statements that finish a batch.
func (r *Relay) detached(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), r.cfg.CloseTimeout)
}

func (t *relayTx) ExecContext(ctx context.Context, query string, args ...any) (wmsql.Result, error) {
	ctx, cancel := t.relay.detached(ctx)
	defer cancel()
	return t.tx.exec(ctx, query, args...)
}

func (t *relayTx) QueryContext(ctx context.Context, query string, args ...any) (wmsql.Rows, error) {
	return t.tx.query(ctx, query, args...)
}

// relayRows adapts pgx.Rows to watermill-sql's Rows and logs the error it would drop.
type relayRows struct {
	rows   pgx.Rows
	logger watermill.LoggerAdapter
}

func (r relayRows) Next() bool             { return r.rows.Next() }
func (r relayRows) Scan(dest ...any) error { return r.rows.Scan(dest...) }

func (r relayRows) Close() error {
	r.rows.Close()
	err := r.rows.Err()
	var pgErr *pgconn.PgError
	switch {
	case err == nil, errors.Is(err, context.Canceled):
	case errors.As(err, &pgErr) && pgErr.Code == "40001":
		r.logger.Debug("Outbox poll lost the consumer group's offset row to another relay; polling again", nil)
	default:
		r.logger.Error("Outbox poll failed while reading rows; watermill-sql treats it as an empty poll and polls again", err, nil)
	}
	return nil
}

// errBatchFailed is what relayTx.Commit returns, wrapped, when a pipelined publish of its batch
// failed and the batch was rolled back. It wraps pgx.ErrTxCommitRollback, which watermill-sql's
// subscriber does not log: the relay logged the publish error itself.
var errBatchFailed = fmt.Errorf("outbox relay: a publish of the batch failed; rolled back to publish it again: %w", pgx.ErrTxCommitRollback)
