package pgstore

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"unicode"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
)

// handlerTx is the transaction a handler gets (TxFromContext): the inbox's pgx.Tx, guarded so
// that nothing the handler does through it can end the inbox transaction behind the inbox's
// back, or write outside it:
//
//   - Commit and Rollback are refused (ErrTxOwnedByInbox) and remembered;
//   - a statement that starts with a transaction-control command (COMMIT, END, ROLLBACK
//     (but ROLLBACK TO SAVEPOINT), ABORT, BEGIN, START TRANSACTION, PREPARE TRANSACTION) is
//     refused before it is sent, and remembered;
//   - once the transaction is no longer open (a multi-statement string that ended it, a closed
//     connection), every further statement is refused, so none runs outside the inbox
//     transaction (it would commit on its own, and be applied again by the redelivery).
//
// A nested transaction (Begin: a savepoint) is the handler's to end. Statements sent through
// Conn() directly are not guarded.
type handlerTx struct {
	pgx.Tx
	ended atomic.Bool
	root  *handlerTx // the inbox transaction's guard, for a nested one; nil on the root
}

func (h *handlerTx) flag() *atomic.Bool {
	if h.root != nil {
		return &h.root.ended
	}
	return &h.ended
}

// refuse marks the transaction as ended by the handler and returns the error it gets.
func (h *handlerTx) refuse(what string) error {
	h.flag().Store(true)
	return fmt.Errorf("%w (%s)", ErrTxOwnedByInbox, what)
}

// check refuses sql when it would end the transaction, or when the transaction is no longer
// open.
func (h *handlerTx) check(sql string) error {
	if h.flag().Load() {
		return fmt.Errorf("%w (the transaction was ended)", ErrTxOwnedByInbox)
	}
	if c := h.Tx.Conn(); c.IsClosed() || c.PgConn().TxStatus() == 'I' {
		return h.refuse("the transaction was ended")
	}
	if txControl(sql) {
		return h.refuse("a transaction-control statement")
	}
	return nil
}

func (h *handlerTx) Commit(ctx context.Context) error {
	if h.root != nil {
		return h.Tx.Commit(ctx)
	}
	return h.refuse("Commit")
}
func (h *handlerTx) Rollback(ctx context.Context) error {
	if h.root != nil {
		return h.Tx.Rollback(ctx)
	}
	return h.refuse("Rollback")
}

func (h *handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if err := h.check(sql); err != nil {
		return pgconn.CommandTag{}, err
	}
	if len(args) == 0 {
		// pgx sends an Exec without arguments in the simple protocol, which runs every
		// statement of a string: one statement per call, in the extended protocol.
		if strings.Contains(strings.TrimRight(sql, "; \t\r\n"), ";") {
			return h.Tx.Conn().PgConn().ExecParams(ctx, sql, nil, nil, nil, nil).Close()
		}
	}
	return h.Tx.Exec(ctx, sql, args...)
}

func (h *handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := h.check(sql); err != nil {
		return nil, err
	}
	return h.Tx.Query(ctx, sql, args...)
}

func (h *handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if err := h.check(sql); err != nil {
		return errRow{err}
	}
	return h.Tx.QueryRow(ctx, sql, args...)
}

func (h *handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	for _, q := range b.QueuedQueries {
		if err := h.check(q.SQL); err != nil {
			return errBatch{err}
		}
	}
	return h.Tx.SendBatch(ctx, b)
}

func (h *handlerTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if err := h.check(""); err != nil {
		return 0, err
	}
	return h.Tx.CopyFrom(ctx, table, cols, src)
}

func (h *handlerTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := h.check(sql); err != nil {
		return nil, err
	}
	return h.Tx.Prepare(ctx, name, sql)
}

func (h *handlerTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := h.check(""); err != nil {
		return nil, err
	}
	tx, err := h.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	root := h
	if h.root != nil {
		root = h.root
	}
	return &handlerTx{Tx: tx, root: root}, nil
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

type errBatch struct{ err error }

func (b errBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, b.err }
func (b errBatch) Query() (pgx.Rows, error)         { return nil, b.err }
func (b errBatch) QueryRow() pgx.Row                { return errRow(b) }
func (b errBatch) Close() error                     { return b.err }
func (b errBatch) Tx() pgx.Tx                       { return nil }

// txControl reports whether sql starts (after white space and comments) with a command that
// ends or starts a transaction: COMMIT, END, ROLLBACK (not ROLLBACK TO [SAVEPOINT]), ABORT,
// BEGIN, START [TRANSACTION], PREPARE TRANSACTION.
func txControl(sql string) bool {
	words := leadingWords(sql, 2)
	if len(words) == 0 {
		return false
	}
	switch words[0] {
	case "commit", "end", "abort", "begin", "start":
		return true
	case "rollback":
		return len(words) < 2 || words[1] != "to"
	case "prepare":
		return len(words) == 2 && words[1] == "transaction"
	}
	return false
}

// leadingWords returns up to n leading keywords of sql, lower-cased, skipping white space,
// -- and /* */ comments and semicolons.
func leadingWords(sql string, n int) []string {
	var words []string
	s := sql
	for len(words) < n {
		s = strings.TrimLeftFunc(s, func(r rune) bool { return unicode.IsSpace(r) || r == ';' })
		switch {
		case strings.HasPrefix(s, "--"):
			if i := strings.IndexByte(s, '\n'); i >= 0 {
				s = s[i+1:]
				continue
			}
			return words
		case strings.HasPrefix(s, "/*"):
			if i := strings.Index(s, "*/"); i >= 0 {
				s = s[i+2:]
				continue
			}
			return words
		}
		i := strings.IndexFunc(s, func(r rune) bool { return !unicode.IsLetter(r) && r != '_' })
		if i < 0 {
			i = len(s)
		}
		if i == 0 {
			return words
		}
		words = append(words, strings.ToLower(s[:i]))
		s = s[i:]
	}
	return words
}

// endedOn returns nil while the inbox transaction on conn is open and the handler has not tried
// to end it, else an error wrapping contract.ErrTxEnded. A transaction in the failed state
// (a swallowed failed statement) is open: COMMIT answers ROLLBACK for it. Nothing is sent.
func (h *handlerTx) endedOn(conn *pgxpool.Conn) error {
	switch {
	case h.ended.Load():
		return fmt.Errorf("%w: it called Commit or Rollback, or sent a transaction-control statement (%w)", contract.ErrTxEnded, contract.ErrCommitRolledBack)
	case conn.Conn().IsClosed():
		return fmt.Errorf("%w: its connection is closed (%w)", contract.ErrTxEnded, contract.ErrCommitRolledBack)
	case conn.Conn().PgConn().TxStatus() == 'I':
		return fmt.Errorf("%w: a statement ended it (%w)", contract.ErrTxEnded, contract.ErrCommitRolledBack)
	}
	return nil
}
