package pgstore_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// The tests' helpers for the storage contract (internal/contract).

// payloadHash is the SHA-256 of payload.
func payloadHash(payload string) []byte {
	h := sha256.Sum256([]byte(payload))
	return h[:]
}

// plain is a delivery of id for consumer, without attempt counting, with the payload hash of
// "p".
func plain(id, consumer string) contract.Delivery {
	return contract.Delivery{Key: contract.Key{MessageID: id, ConsumerName: consumer}, PayloadHash: payloadHash("p")}
}

// countedFirst is plain with attempt counting (MaxAttempts 3), counted before its handler
// when first.
func countedFirst(d contract.Delivery, first bool) contract.Delivery {
	d.MaxAttempts, d.CountFirst = 3, first
	return d
}

func decisionName(d contract.Decision) string {
	switch d {
	case contract.Run:
		return "Run"
	case contract.Duplicate:
		return "Duplicate"
	case contract.Collision:
		return "Collision"
	case contract.DeadLettered:
		return "DeadLettered"
	case contract.Exhausted:
		return "Exhausted"
	case contract.RunAlone:
		return "RunAlone"
	}
	return "none"
}

// mustClaim claims d and fails t unless it decides want; it returns the Tx (Run only).
func mustClaim(t testing.TB, s contract.Store, d contract.Delivery, want contract.Decision) (contract.Tx, contract.Claim) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	tx, c, err := s.Claim(ctx, d)
	if err != nil {
		t.Fatalf("claim %s: %v", d.Key.MessageID, err)
	}
	if c.Decision != want || (tx != nil) != (want == contract.Run) {
		if tx != nil {
			_, _ = tx.Fail(context.Background(), contract.Failure{})
		}
		t.Fatalf("claim %s: decision %s (Tx %v), want %s (%+v)", d.Key.MessageID, decisionName(c.Decision), tx != nil, decisionName(want), c)
	}
	return tx, c
}

// mustCommit claims d (decided Run) and commits.
func mustCommit(t testing.TB, s contract.Store, d contract.Delivery) {
	t.Helper()
	tx, _ := mustClaim(t, s, d, contract.Run)
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatalf("commit %s: %v", d.Key.MessageID, err)
	}
}

// release ends tx without recording anything (a failure that is not the message's); for
// deferred clean-up, where tx may have ended already.
func release(tx contract.Tx) {
	if tx != nil {
		_, _ = tx.Fail(context.Background(), contract.Failure{})
	}
}

// handlerTx is the pgx transaction a handler finds in the context of tx (a contract.Tx or a
// contract.BatchTx).
func handlerTx(t testing.TB, tx interface {
	Context(context.Context) context.Context
}) pgx.Tx {
	t.Helper()
	ptx, ok := pgstore.TxFromContext(tx.Context(context.Background()))
	if !ok {
		t.Fatal("TxFromContext found no transaction in the claim's context")
	}
	return ptx
}

// attemptsRow reads k's record in s's attempts table: its count, and false when there is none.
func attemptsRow(t testing.TB, pool querier, s *pgstore.Store, k contract.Key) (int, bool) {
	t.Helper()
	var n int
	err := pool.QueryRow(context.Background(), "SELECT attempts FROM "+s.AttemptsTable()+" WHERE message_id = $1 AND consumer_name = $2",
		k.MessageID, k.ConsumerName).Scan(&n)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return n, true
}

// querier is a pool or a connection.
type querier interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}

// sideConn is a connection to sch outside its pool, for reads while the pool's connections
// are all in use; closed when t ends.
func sideConn(t testing.TB, url string) *pgx.Conn {
	t.Helper()
	c, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

// claimRows counts the rows of s's inbox table whose message ID is id.
func claimRows(t testing.TB, pool querier, s *pgstore.Store, id string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+s.Table()+" WHERE message_id::text = $1", id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// advisoryLocks counts the advisory locks the session running the query holds.
func advisoryLocks(t testing.TB, q querier) int {
	t.Helper()
	var n int
	if err := q.QueryRow(context.Background(), "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
