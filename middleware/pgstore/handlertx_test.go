package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// handlerEnd is one way a handler ends (or breaks) the inbox transaction it was given.
type handlerEnd struct {
	name string
	// ended: the inbox's Commit must say the handler ended the transaction (ErrTxEnded);
	// otherwise only that it rolled back.
	ended bool
	end   func(t *testing.T, ctx context.Context, tx pgx.Tx)
}

var handlerEnds = []handlerEnd{
	{"Commit", true, func(t *testing.T, ctx context.Context, tx pgx.Tx) {
		if err := tx.Commit(ctx); !errors.Is(err, pgstore.ErrTxOwnedByInbox) {
			t.Fatalf("Commit on the handler's transaction: %v, want ErrTxOwnedByInbox", err)
		}
	}},
	{"Rollback", true, func(t *testing.T, ctx context.Context, tx pgx.Tx) {
		if err := tx.Rollback(ctx); !errors.Is(err, pgstore.ErrTxOwnedByInbox) {
			t.Fatalf("Rollback on the handler's transaction: %v, want ErrTxOwnedByInbox", err)
		}
	}},
	{"rollback-statement", true, func(t *testing.T, ctx context.Context, tx pgx.Tx) {
		// Refused before it is sent: it would end the inbox transaction.
		if _, err := tx.Exec(ctx, "rollback"); !errors.Is(err, pgstore.ErrTxOwnedByInbox) {
			t.Fatalf("ROLLBACK through the handler's transaction: %v, want ErrTxOwnedByInbox", err)
		}
	}},
	{"commit-statement", true, func(t *testing.T, ctx context.Context, tx pgx.Tx) {
		// Refused before it is sent: it would end the inbox transaction.
		if _, err := tx.Exec(ctx, "commit"); !errors.Is(err, pgstore.ErrTxOwnedByInbox) {
			t.Fatalf("COMMIT through the handler's transaction: %v, want ErrTxOwnedByInbox", err)
		}
	}},
	{"rollback-in-a-string", false, func(t *testing.T, ctx context.Context, tx pgx.Tx) {
		// One statement per call: PostgreSQL refuses the string (SQLSTATE 42601), so nothing
		// ends the transaction; it is aborted.
		if _, err := tx.Exec(ctx, "SELECT 1; ROLLBACK"); err == nil {
			t.Fatal("a string of statements was sent whole")
		}
	}},
	{"close-connection", true, func(t *testing.T, ctx context.Context, tx pgx.Tx) {
		if err := tx.Conn().Close(ctx); err != nil {
			t.Fatal(err)
		}
	}},
	{"swallowed-failure", false, func(t *testing.T, ctx context.Context, tx pgx.Tx) {
		if _, err := tx.Exec(ctx, "SELECT 1/0"); err == nil {
			t.Fatal("SELECT 1/0 did not fail")
		}
		// The handler returns nil anyway.
	}},
}

// checkCommitRefused fails t unless err is the Commit error of a transaction the handler
// ended (h.ended) or broke.
func checkCommitRefused(t *testing.T, h handlerEnd, err error) {
	t.Helper()
	if !errors.Is(err, contract.ErrCommitRolledBack) {
		t.Fatalf("Commit after the handler's %s: %v, want ErrCommitRolledBack", h.name, err)
	}
	if errors.Is(err, contract.ErrTxEnded) != h.ended {
		t.Fatalf("Commit after the handler's %s: %v; wraps ErrTxEnded %v, want %v", h.name, err, errors.Is(err, contract.ErrTxEnded), h.ended)
	}
}

// effects counts the business rows of id.
func effects(t *testing.T, sch *testenv.Schema, id string) int {
	t.Helper()
	var n int
	if err := sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM effects WHERE id = $1", id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestHandlerEndingTheTransactionIsNeverCommitted: a handler that writes, then ends the inbox
// transaction it was given (Commit or Rollback on it, a ROLLBACK or COMMIT statement through
// it, closing its connection) or swallows a failed statement: the inbox's Commit returns an
// error wrapping ErrCommitRolledBack (and ErrTxEnded, but for the swallowed failure), neither
// the claim nor the business write is in the tables afterwards, Fail then records the failure
// (with counting: one attempt, counted first or not), and the key's next delivery runs.
func TestHandlerEndingTheTransactionIsNeverCommitted(t *testing.T) {
	for _, h := range handlerEnds {
		for _, path := range claimPaths {
			t.Run(h.name+"/"+path.name, func(t *testing.T) {
				sch := testenv.NewSchema(t, 4)
				s := sch.Store(t)
				sch.Exec(t, "CREATE TABLE effects (id text PRIMARY KEY)")
				ctx := context.Background()
				d := path.delivery(plain("m-"+h.name, "c"))
				tx, _ := mustClaim(t, s, d, contract.Run)
				ptx := handlerTx(t, tx)
				if _, err := ptx.Exec(ctx, "INSERT INTO effects VALUES ($1)", d.Key.MessageID); err != nil {
					t.Fatal(err)
				}
				h.end(t, ctx, ptx)
				err := tx.Commit(ctx)
				checkCommitRefused(t, h, err)
				n, ferr := tx.Fail(ctx, contract.Failure{Counts: true, Error: err.Error()})
				if ferr != nil {
					t.Fatalf("Fail after the refused Commit: %v", ferr)
				}
				if rows := claimRows(t, sch.Pool, s, d.Key.MessageID); rows != 0 {
					t.Errorf("the claim is in the table after the handler's %s (%d rows): the delivery would be a duplicate", h.name, rows)
				}
				if e := effects(t, sch, d.Key.MessageID); e != 0 {
					t.Errorf("the business write is in the table after the handler's %s (%d rows)", h.name, e)
				}
				got, _ := attemptsRow(t, sch.Pool, s, d.Key)
				if want := b2i(path.counted); got != want || n != want {
					t.Errorf("%d attempts recorded (Fail said %d), want %d", got, n, want)
				}
				// The pool is usable and the key free: the next delivery runs and commits.
				tx, c := mustClaim(t, s, d, contract.Run)
				if c.Attempts != b2i(path.counted) {
					t.Errorf("redelivery: %d earlier attempts, want %d", c.Attempts, b2i(path.counted))
				}
				if _, err := handlerTx(t, tx).Exec(ctx, "INSERT INTO effects VALUES ($1) ON CONFLICT DO NOTHING", d.Key.MessageID); err != nil {
					t.Fatal(err)
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
				if rows, e := claimRows(t, sch.Pool, s, d.Key.MessageID), effects(t, sch, d.Key.MessageID); rows != 1 || e != 1 {
					t.Errorf("after the redelivery: %d claims, %d effects; want 1 and 1", rows, e)
				}
				if _, ok := attemptsRow(t, sch.Pool, s, d.Key); ok {
					t.Error("the commit left the attempt record")
				}
			})
		}
	}
}

// TestBatchMemberEndingTheTransactionIsNeverCommitted: the same in a batch: members a and b
// run, each after a Savepoint, and b's handler ends or breaks the batch's transaction after
// writing. Healthy reports it (ErrTxEnded, but for the swallowed failure), the batch's Commit
// returns an error wrapping ErrCommitRolledBack, and neither member's claim nor business
// write is in the tables; with counting, the counts made before the handlers are taken back.
// Both keys run again afterwards.
func TestBatchMemberEndingTheTransactionIsNeverCommitted(t *testing.T) {
	for _, h := range handlerEnds {
		for _, counted := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/counted=%v", h.name, counted), func(t *testing.T) {
				sch := testenv.NewSchema(t, 4)
				s := sch.Store(t)
				sch.Exec(t, "CREATE TABLE effects (id text PRIMARY KEY)")
				ctx := context.Background()
				ds := []contract.Delivery{plain("a-"+h.name, "c"), plain("b-"+h.name, "c")}
				if counted {
					for k := range ds {
						ds[k] = countedFirst(ds[k], true)
					}
				}
				bt, cs, err := s.ClaimBatch(ctx, ds)
				if err != nil {
					t.Fatal(err)
				}
				for k, c := range cs {
					if c.Decision != contract.Run {
						t.Fatalf("member %d: %s", k, decisionName(c.Decision))
					}
				}
				for k, d := range ds {
					if err := bt.Savepoint(ctx); err != nil {
						t.Fatal(err)
					}
					ptx := handlerTx(t, bt)
					if _, err := ptx.Exec(ctx, "INSERT INTO effects VALUES ($1)", d.Key.MessageID); err != nil {
						t.Fatal(err)
					}
					if k == 1 {
						h.end(t, ctx, ptx)
					}
				}
				herr := bt.Healthy()
				if herr == nil {
					t.Fatalf("Healthy after the handler's %s: nil", h.name)
				}
				if errors.Is(herr, contract.ErrTxEnded) != h.ended {
					t.Fatalf("Healthy after the handler's %s: %v; wraps ErrTxEnded %v, want %v", h.name, herr, errors.Is(herr, contract.ErrTxEnded), h.ended)
				}
				checkCommitRefused(t, h, bt.Commit(ctx))
				for _, d := range ds {
					if rows := claimRows(t, sch.Pool, s, d.Key.MessageID); rows != 0 {
						t.Errorf("%s: the claim is in the table after the handler's %s (%d rows)", d.Key.MessageID, h.name, rows)
					}
					if e := effects(t, sch, d.Key.MessageID); e != 0 {
						t.Errorf("%s: the business write is in the table after the handler's %s (%d rows)", d.Key.MessageID, h.name, e)
					}
					if n, ok := attemptsRow(t, sch.Pool, s, d.Key); ok {
						t.Errorf("%s: %d attempts recorded, want no record (the counts taken back)", d.Key.MessageID, n)
					}
				}
				for _, d := range ds {
					mustCommit(t, s, d)
				}
				if rows, records := rowsAndRecords(t, sch.Pool, s); rows != 2 || records != 0 {
					t.Errorf("after the redeliveries: %d rows, %d attempt records; want 2 and 0", rows, records)
				}
			})
		}
	}
}
