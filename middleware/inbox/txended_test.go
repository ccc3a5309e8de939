package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// endings are the ways a handler can end, abort or poison the inbox transaction it was given
// and still return nil.
var endings = map[string]func(ctx context.Context) error{
	"Rollback": func(ctx context.Context) error {
		tx, _ := pgstore.TxFromContext(ctx)
		_ = tx.Rollback(ctx)
		return nil
	},
	"Commit": func(ctx context.Context) error {
		tx, _ := pgstore.TxFromContext(ctx)
		_ = tx.Commit(ctx)
		return nil
	},
	"rollback-statement": func(ctx context.Context) error {
		tx, _ := pgstore.TxFromContext(ctx)
		_, err := tx.Exec(ctx, "rollback")
		return err
	},
	"commit-statement": func(ctx context.Context) error {
		tx, _ := pgstore.TxFromContext(ctx)
		_, err := tx.Exec(ctx, "commit")
		return err
	},
	"commit-inside-a-multi-statement-string": func(ctx context.Context) error {
		tx, _ := pgstore.TxFromContext(ctx)
		_, err := tx.Exec(ctx, "SELECT 1; COMMIT")
		return err
	},
	"rollback-inside-a-multi-statement-string-then-a-write": func(ctx context.Context) error {
		tx, _ := pgstore.TxFromContext(ctx)
		if _, err := tx.Exec(ctx, "SELECT 1; ROLLBACK"); err != nil {
			return err
		}
		// Refused: it would commit on its own, outside the inbox transaction.
		_, _ = tx.Exec(ctx, "UPDATE accounts SET balance = balance + 1000 WHERE id = 3")
		return nil
	},
	"closed-connection": func(ctx context.Context) error {
		tx, _ := pgstore.TxFromContext(ctx)
		_ = tx.Conn().Close(ctx)
		return nil
	},
	"swallowed-failed-statement": func(ctx context.Context) error {
		tx, _ := pgstore.TxFromContext(ctx)
		_, _ = tx.Exec(ctx, "SELECT 1/0")
		return nil
	},
	"rolled-back-own-savepoint-then-release-inbox-state": func(ctx context.Context) error {
		// A nested transaction is the handler's own: ending it is fine, and the
		// delivery commits (the control case: no false nack).
		tx, _ := pgstore.TxFromContext(ctx)
		sp, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := sp.Exec(ctx, "UPDATE accounts SET balance = balance + 1000000 WHERE id = 7"); err != nil {
			return err
		}
		return sp.Rollback(ctx)
	},
}

// TestHandlerThatEndsTheTransactionIsNacked: a handler that writes its payment and then ends,
// aborts or poisons the inbox transaction, and returns nil, is nacked, never acked, and leaves
// neither its claim nor its write: its redelivery runs the handler again and applies the
// payment once. The control case (a nested transaction the handler ends itself) commits.
func TestHandlerThatEndsTheTransactionIsNacked(t *testing.T) {
	for name, end := range endings {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, 4)
			ib := e.inbox("billing", withDeadLetters(newDeadLetters(t), 5))
			var misbehave = true
			h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				if _, err := e.credit(msg); err != nil {
					return nil, err
				}
				if misbehave {
					return nil, end(msg.Context())
				}
				return nil, nil
			})
			msg := paymentMsg("m-ends", 3, 5)
			err := deliver(h, msg)
			control := name == "rolled-back-own-savepoint-then-release-inbox-state"
			if control {
				if err != nil || e.balance(3) != 5 || e.balance(7) != 0 || e.rows("") != 1 {
					t.Fatalf("control: err %v, balance %d / %d, rows %d; want committed once", err, e.balance(3), e.balance(7), e.rows(""))
				}
				return
			}
			if err == nil {
				t.Fatalf("acked although the handler ended the transaction (balance %d, rows %d)", e.balance(3), e.rows(""))
			}
			var pgErr *pgconn.PgError
			switch {
			case errors.Is(err, pgstore.ErrTxOwnedByInbox): // the handler returned the refusal
			case errors.As(err, &pgErr) && pgErr.Code == "42601": // one statement per call
			case !errors.Is(err, inbox.ErrCommitRolledBack):
				t.Fatalf("error %v, want one wrapping ErrCommitRolledBack", err)
			case name != "swallowed-failed-statement" && !errors.Is(err, inbox.ErrTxEnded):
				t.Fatalf("error %v, want one wrapping ErrTxEnded", err)
			}
			if e.rows("") != 0 || e.balance(3) != 0 {
				t.Fatalf("after the nack: rows %d, balance %d; want nothing", e.rows(""), e.balance(3))
			}
			misbehave = false
			if err := deliver(h, msg); err != nil {
				t.Fatal(err)
			}
			if e.rows("") != 1 || e.balance(3) != 5 {
				t.Fatalf("after the redelivery: rows %d, balance %d; want 1, 5", e.rows(""), e.balance(3))
			}
		})
	}
}

// TestBatchedHandlerThatEndsTheTransaction: in the batched mode, at every position of a
// batch of four, a member whose handler ends the shared transaction is nacked, and every
// other member (those before it in the same transaction included) is processed exactly once.
func TestBatchedHandlerThatEndsTheTransaction(t *testing.T) {
	for name, end := range endings {
		if name == "rolled-back-own-savepoint-then-release-inbox-state" {
			continue
		}
		for _, mode := range batchModes {
			for pos := range 4 {
				t.Run(fmt.Sprintf("%s/%s/position-%d", name, mode, pos), func(t *testing.T) {
					e := newEnv(t, 8)
					ib := e.inbox("billing", withBatch(4, mode))
					bad := fmt.Sprintf("m-%d", pos)
					h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
						if _, err := e.credit(msg); err != nil {
							return nil, err
						}
						if msg.UUID == bad {
							return nil, end(msg.Context())
						}
						return nil, nil
					})
					msgs := make([]*message.Message, 4)
					for k := range msgs {
						msgs[k] = paymentMsg(fmt.Sprintf("m-%d", k), 2, int64(1)<<(4*k))
					}
					errs := deliverAll(h, msgs...)
					committed := false
					var want int64
					for k, err := range errs {
						if (k == pos && !committed) != (err != nil) {
							t.Fatalf("delivery %d: %v; only member %d must be nacked", k, err, pos)
						}
						if k != pos || committed {
							want += int64(1) << (4 * k)
						}
					}
					if committed {
						if b := e.balance(2); b != want || e.rows("") != 4 {
							t.Fatalf("balance %#x, rows %d; want %#x, 4", b, e.rows(""), want)
						}
						return
					}
					if b := e.balance(2); b != want {
						t.Fatalf("balance %#x, want %#x: a member's payment was lost or applied twice", b, want)
					}
					if n := e.rows("message_id = $1", bad); n != 0 || e.rows("") != 3 {
						t.Fatalf("rows: %d for the bad member, %d in all; want 0, 3", n, e.rows(""))
					}
				})
			}
		}
	}
}
