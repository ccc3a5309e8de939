package inbox_test

// Adversarial review of the storage contract v3, through the middleware: ways a handler can
// end or escape the inbox transaction it was given that the guard (pgstore's handlerTx) lets
// through, and what becomes of the message.

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// review3Escapes end the inbox transaction (with its claim) and leave the handler a
// transaction to write in, through the API the handler is given; each returns where the
// payment is to be written.
var review3Escapes = map[string]func(ctx context.Context) (pgx.Tx, error){
	// One string: the guard reads only its leading keyword; pgx sends an Exec without
	// arguments in the simple protocol, which runs every statement of it.
	"rollback-begin-in-one-string": func(ctx context.Context) (pgx.Tx, error) {
		tx, _ := pgstore.TxFromContext(ctx)
		_, err := tx.Exec(ctx, "SELECT 1; ROLLBACK; BEGIN")
		return tx, err
	},
	// Begin returns pgx's savepoint transaction over the inner, unguarded pgx.Tx.
	"rollback-begin-through-a-nested-transaction": func(ctx context.Context) (pgx.Tx, error) {
		tx, _ := pgstore.TxFromContext(ctx)
		sp, err := tx.Begin(ctx)
		if err != nil {
			return nil, err
		}
		if _, err := sp.Exec(ctx, "ROLLBACK"); err != nil {
			return nil, err
		}
		_, err = sp.Exec(ctx, "BEGIN")
		return tx, err
	},
}

// review3Pay writes msg's payment (5 to account 3) through tx.
func review3Pay(ctx context.Context, tx pgx.Tx) error {
	_, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + 5 WHERE id = 3")
	return err
}

// TestReview3EscapedTransactionIsNotAcked: a handler that escapes the inbox transaction
// (review3Escapes) and then writes its payment is acked although its claim never committed;
// a copy of the message (a broker redelivery) runs it again and the payment is applied
// twice. Either the delivery must not be acked, or the claim must be there.
//
// Fails on the reviewed code (acked, 0 claims, balance 10).
func TestReview3EscapedTransactionIsNotAcked(t *testing.T) {
	for name, escape := range review3Escapes {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, 4)
			ib := e.inbox("billing", withDeadLetters(newDeadLetters(t), 5))
			h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				tx, err := escape(msg.Context())
				if err != nil {
					return nil, err
				}
				return nil, review3Pay(msg.Context(), tx)
			})
			msg := paymentMsg("m-escape", 3, 5)
			err := deliver(h, msg)
			if err == nil && e.rows("message_id = $1", "m-escape") != 1 {
				t.Errorf("acked with %d claims (balance %d): the message was processed without its claim", e.rows("message_id = $1", "m-escape"), e.balance(3))
			}
			_ = deliver(h, msg) // a copy
			if b := e.balance(3); b > 5 {
				t.Errorf("balance %d after a copy: the payment was applied %d times", b, b/5)
			}
		})
	}
}

// TestReview3BatchedEscapedTransactionIsNotAcked: the same in the batched mode, the member at
// position 0 of a batch of four escaping: its string rolls back the claims of all four, and
// the members after it commit their payments without claims. Every member is acked; every
// copy runs again.
//
// Fails on the reviewed code (optimistic mode; with savepoints the next SAVEPOINT fails and
// the batch is nacked).
func TestReview3BatchedEscapedTransactionIsNotAcked(t *testing.T) {
	for name, escape := range review3Escapes {
		for _, mode := range batchModes {
			t.Run(fmt.Sprintf("%s/%s", name, mode), func(t *testing.T) {
				e := newEnv(t, 8)
				ib := e.inbox("billing", withBatch(4, mode))
				h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					ctx := msg.Context()
					tx, _ := pgstore.TxFromContext(ctx)
					if msg.UUID == "m-0" {
						var err error
						if tx, err = escape(ctx); err != nil {
							return nil, err
						}
					}
					_, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + 1 WHERE id = 2")
					return nil, err
				})
				msgs := make([]*message.Message, 4)
				for k := range msgs {
					msgs[k] = paymentMsg(fmt.Sprintf("m-%d", k), 2, 1)
				}
				errs := deliverAll(h, msgs...)
				for k, err := range errs {
					id := fmt.Sprintf("m-%d", k)
					if n := e.rows("message_id = $1", id); err == nil && n != 1 {
						t.Errorf("%s: acked with %d claims", id, n)
					}
				}
			})
		}
	}
}
