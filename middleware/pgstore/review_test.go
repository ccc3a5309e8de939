package pgstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestBatchClaimLockTimeoutReleasesTheLocksItTook: a counted batch claim whose lock statement
// fails part-way (LockTimeout, SQLSTATE 55P03, on the second key, held by a delivery in
// flight) has already taken the first key's session lock, which a rollback does not release:
// the connection must go back to the pool holding no advisory lock, and nothing is counted.
func TestBatchClaimLockTimeoutReleasesTheLocksItTook(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	sch.Store(t) // migrated
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, LockTimeout: 150 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	// "m-b" is held: a counted delivery in flight holds its session lock.
	held, _, err := s.ClaimCounted(ctx, inbox.CountedClaimParams{ClaimParams: inbox.ClaimParams{Key: inbox.Key{MessageID: "m-b", ConsumerName: "c"}}, CountFirst: true})
	if err != nil || held == nil {
		t.Fatalf("claim m-b: %v", err)
	}
	defer held.Rollback(ctx)
	claims := []inbox.CountedClaimParams{
		{ClaimParams: inbox.ClaimParams{Key: inbox.Key{MessageID: "m-a", ConsumerName: "c"}}, CountFirst: true},
		{ClaimParams: inbox.ClaimParams{Key: inbox.Key{MessageID: "m-b", ConsumerName: "c"}}, CountFirst: true},
	}
	tx, _, err := s.ClaimBatch(ctx, inbox.BatchClaimParams{Claims: claims, Counted: true})
	if err == nil {
		_ = tx.Rollback(ctx)
		t.Fatal("a batch claim behind a held key did not time out")
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != pgstore.SQLStateLockNotAvailable {
		t.Fatalf("batch claim: %v, want SQLSTATE 55P03", err)
	}
	// The pool's other connection is the one the batch used.
	var locks int
	if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()").Scan(&locks); err != nil {
		t.Fatal(err)
	}
	if locks != 0 {
		t.Fatalf("the failed batch claim's connection went back to the pool holding %d advisory locks", locks)
	}
	var rows int
	if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+s.AttemptsTable()+" WHERE message_id = 'm-a'").Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("attempt rows of m-a = %d (%v), want 0: the batch never claimed it", rows, err)
	}
}
