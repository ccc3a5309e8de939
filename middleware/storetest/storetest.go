// Package storetest is the conformance suite every inbox Store must pass. The inbox's
// guarantee lives in the store (its unique key and its transactions), so the suite runs against
// a real database, never a mock:
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) inbox.Store {
//			store, _ := pgstore.New(pool, pgstore.Config{Schema: freshSchema(t)})
//			_, _ = store.Migrate(ctx)
//			return store
//		})
//	}
//
// NewStore must return a store on empty, migrated storage for each call, and its pool must
// allow at least 4 concurrent connections.
package storetest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// blockWindow is how long a claim is expected to stay blocked behind an uncommitted claim of
// the same key before the suite releases it.
const blockWindow = 300 * time.Millisecond

// Run runs every conformance test as a subtest of t.
func Run(t *testing.T, newStore func(t *testing.T) inbox.Store) {
	tests := []struct {
		name string
		fn   func(t *testing.T, s inbox.Store)
	}{
		{"FirstClaimWins", testFirstClaimWins},
		{"DuplicateLeavesTransactionUsable", testDuplicateLeavesTransactionUsable},
		{"RollbackLeavesNoMark", testRollbackLeavesNoMark},
		{"ConsumerNamesAreIndependent", testConsumerNamesAreIndependent},
		{"ConcurrentClaimWaitsThenSeesDuplicate", testConcurrentClaimWaitsThenSeesDuplicate},
		{"ConcurrentClaimProceedsAfterRollback", testConcurrentClaimProceedsAfterRollback},
		{"DistinctKeysDoNotBlock", testDistinctKeysDoNotBlock},
		{"RepeatableReadConflictIsRetryable", testRepeatableReadConflictIsRetryable},
		{"CancelledContextLeavesNothingOpen", testCancelledContextLeavesNothingOpen},
		{"RetryableRejectsOrdinaryErrors", testRetryableRejectsOrdinaryErrors},
		{"DuplicateReportsStoredPayloadHash", testDuplicateReportsStoredPayloadHash},
		{"AttemptsSurviveRollbacks", testAttemptsSurviveRollbacks},
		{"CommitClearsAttempts", testCommitClearsAttempts},
		{"DeadLetteredUntilReplay", testDeadLetteredUntilReplay},
		{"RecordFailureAcceptsAnyText", testRecordFailureAcceptsAnyText},
		{"ConcurrentCountedClaims", testConcurrentCountedClaims},
		{"LockTimeoutEndsTheWait", testLockTimeoutEndsTheWait},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.fn(t, newStore(t)) })
	}
}

var rc = inbox.TxOptions{Isolation: sql.LevelReadCommitted}

func claim(id string) inbox.Claim {
	return inbox.Claim{MessageID: id, ConsumerName: "conformance", MessageType: "Test", CorrelationID: "corr-1", PayloadHash: make([]byte, 32)}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// mustClaim claims c in a new transaction and returns it with the claim result.
func mustClaim(t *testing.T, s inbox.Store, opts inbox.TxOptions, c inbox.Claim) (inbox.Tx, bool) {
	t.Helper()
	tx, res := mustClaimResult(t, s, opts, c)
	return tx, res.Claimed
}

func mustClaimResult(t *testing.T, s inbox.Store, opts inbox.TxOptions, c inbox.Claim) (inbox.Tx, inbox.ClaimResult) {
	t.Helper()
	tx, res, err := s.BeginClaim(ctxT(t), opts, c)
	if err != nil {
		t.Fatalf("BeginClaim(%q, %q): %v", c.MessageID, c.ConsumerName, err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx, res
}

// committedClaim claims and commits c, returning whether the claim was new.
func committedClaim(t *testing.T, s inbox.Store, c inbox.Claim) bool {
	t.Helper()
	tx, claimed := mustClaim(t, s, rc, c)
	if err := tx.Commit(ctxT(t)); err != nil {
		t.Fatalf("Commit after claim of %q (claimed=%v): %v", c.MessageID, claimed, err)
	}
	return claimed
}

func testFirstClaimWins(t *testing.T, s inbox.Store) {
	if !committedClaim(t, s, claim("m-1")) {
		t.Fatal("first claim of m-1 reported a duplicate on empty storage")
	}
	for i := range 3 {
		if committedClaim(t, s, claim("m-1")) {
			t.Fatalf("claim %d of committed m-1 was accepted again", i+2)
		}
	}
}

func testDuplicateLeavesTransactionUsable(t *testing.T, s inbox.Store) {
	committedClaim(t, s, claim("m-dup"))
	tx, claimed := mustClaim(t, s, rc, claim("m-dup"))
	if claimed {
		t.Fatal("duplicate claim accepted")
	}
	// A caught unique violation would abort the transaction (SQLSTATE 25P02 on the next
	// statement, ROLLBACK on COMMIT); a duplicate must leave it committable.
	if err := tx.Commit(ctxT(t)); err != nil {
		t.Fatalf("Commit after a duplicate claim: %v (the duplicate aborted the transaction)", err)
	}
	if !committedClaim(t, s, claim("m-after-dup")) {
		t.Fatal("claim after a duplicate was refused")
	}
}

func testRollbackLeavesNoMark(t *testing.T, s inbox.Store) {
	tx, claimed := mustClaim(t, s, rc, claim("m-rb"))
	if !claimed {
		t.Fatal("first claim refused")
	}
	if err := tx.Rollback(ctxT(t)); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	if err := tx.Rollback(ctxT(t)); err != nil {
		t.Fatalf("second Rollback must be a no-op, got %v", err)
	}
	if !committedClaim(t, s, claim("m-rb")) {
		t.Fatal("a rolled-back claim left a processed mark: the redelivery was treated as a duplicate")
	}
}

func testConsumerNamesAreIndependent(t *testing.T, s inbox.Store) {
	a := claim("m-shared")
	a.ConsumerName = "billing"
	b := claim("m-shared")
	b.ConsumerName = "notifications"
	txA, okA := mustClaim(t, s, rc, a)
	// B must not wait on A's uncommitted row: a different consumer is a different key.
	done := make(chan bool, 1)
	go func() {
		tx, ok, err := s.BeginClaim(ctxT(t), rc, b)
		if err != nil {
			t.Errorf("claim for second consumer: %v", err)
			done <- false
			return
		}
		if err := tx.Commit(context.Background()); err != nil {
			t.Errorf("commit for second consumer: %v", err)
		}
		done <- ok.Claimed
	}()
	select {
	case okB := <-done:
		if !okA || !okB {
			t.Fatalf("claims for two consumers of one message: billing=%v notifications=%v, want both true", okA, okB)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a claim for another consumer blocked on an uncommitted claim of the same message ID")
	}
	if err := txA.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if committedClaim(t, s, a) || committedClaim(t, s, b) {
		t.Fatal("a committed per-consumer claim was accepted again")
	}
}

type claimResult struct {
	tx      inbox.Tx
	claimed bool
	err     error
}

// claimInBackground starts a claim of c and returns its result channel.
func claimInBackground(t *testing.T, s inbox.Store, opts inbox.TxOptions, c inbox.Claim) <-chan claimResult {
	ch := make(chan claimResult, 1)
	go func() {
		tx, res, err := s.BeginClaim(ctxT(t), opts, c)
		ch <- claimResult{tx, res.Claimed, err}
	}()
	return ch
}

func expectBlocked(t *testing.T, ch <-chan claimResult) {
	t.Helper()
	select {
	case r := <-ch:
		t.Fatalf("a concurrent claim of an uncommitted key returned at once (claimed=%v err=%v); it must wait on the first transaction", r.claimed, r.err)
	case <-time.After(blockWindow):
	}
}

func expectResult(t *testing.T, ch <-chan claimResult) claimResult {
	t.Helper()
	select {
	case r := <-ch:
		if r.err == nil {
			t.Cleanup(func() { _ = r.tx.Rollback(context.Background()) })
		}
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("a blocked claim did not return after the first transaction ended")
		return claimResult{}
	}
}

func testConcurrentClaimWaitsThenSeesDuplicate(t *testing.T, s inbox.Store) {
	first, ok := mustClaim(t, s, rc, claim("m-race"))
	if !ok {
		t.Fatal("first claim refused")
	}
	second := claimInBackground(t, s, rc, claim("m-race"))
	expectBlocked(t, second)
	if err := first.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	r := expectResult(t, second)
	if r.err != nil {
		t.Fatalf("blocked claim ended with an error after the first committed: %v (want a duplicate, not a unique violation)", r.err)
	}
	if r.claimed {
		t.Fatal("both concurrent claims of one key were accepted")
	}
	if err := r.tx.Commit(ctxT(t)); err != nil {
		t.Fatalf("commit of the losing (duplicate) transaction: %v", err)
	}
}

func testConcurrentClaimProceedsAfterRollback(t *testing.T, s inbox.Store) {
	first, ok := mustClaim(t, s, rc, claim("m-race-rb"))
	if !ok {
		t.Fatal("first claim refused")
	}
	second := claimInBackground(t, s, rc, claim("m-race-rb"))
	expectBlocked(t, second)
	if err := first.Rollback(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	r := expectResult(t, second)
	if r.err != nil || !r.claimed {
		t.Fatalf("after the first claim rolled back the waiting claim got claimed=%v err=%v, want claimed", r.claimed, r.err)
	}
	if err := r.tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if committedClaim(t, s, claim("m-race-rb")) {
		t.Fatal("claim accepted again after the second transaction committed")
	}
}

func testDistinctKeysDoNotBlock(t *testing.T, s inbox.Store) {
	_, ok := mustClaim(t, s, rc, claim("m-a"))
	if !ok {
		t.Fatal("claim refused")
	}
	r := claimInBackground(t, s, rc, claim("m-b"))
	select {
	case res := <-r:
		if res.err != nil || !res.claimed {
			t.Fatalf("claim of another key: claimed=%v err=%v", res.claimed, res.err)
		}
		_ = res.tx.Rollback(context.Background())
	case <-time.After(5 * time.Second):
		t.Fatal("a claim of a different key blocked on an uncommitted claim")
	}
}

func testRepeatableReadConflictIsRetryable(t *testing.T, s inbox.Store) {
	rr := inbox.TxOptions{Isolation: sql.LevelRepeatableRead}
	first, ok := mustClaim(t, s, rr, claim("m-rr"))
	if !ok {
		t.Fatal("first claim refused")
	}
	second := claimInBackground(t, s, rr, claim("m-rr"))
	expectBlocked(t, second)
	if err := first.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	r := expectResult(t, second)
	switch {
	case r.err != nil && s.Retryable(r.err):
		// The conflicting row was committed after this transaction's snapshot: a
		// serialization failure, to be retried as a whole.
	case r.err == nil && !r.claimed:
		// Also acceptable: the store resolved it as a duplicate.
		_ = r.tx.Rollback(context.Background())
	default:
		t.Fatalf("concurrent REPEATABLE READ claim: claimed=%v err=%v retryable=%v; want a retryable error or a duplicate", r.claimed, r.err, r.err != nil && s.Retryable(r.err))
	}
	// The retry in a fresh transaction sees the committed row.
	if committedClaim(t, s, claim("m-rr")) {
		t.Fatal("retry of the REPEATABLE READ conflict was accepted as new")
	}
}

func testCancelledContextLeavesNothingOpen(t *testing.T, s inbox.Store) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if tx, _, err := s.BeginClaim(ctx, rc, claim("m-cancel")); err == nil {
		_ = tx.Rollback(context.Background())
		t.Fatal("BeginClaim with a cancelled context succeeded")
	}
	if !committedClaim(t, s, claim("m-cancel")) {
		t.Fatal("a claim attempted with a cancelled context left a mark")
	}
}

func testRetryableRejectsOrdinaryErrors(t *testing.T, s inbox.Store) {
	for _, err := range []error{nil, errors.New("boom"), context.Canceled, fmt.Errorf("wrapped: %w", context.DeadlineExceeded)} {
		if s.Retryable(err) {
			t.Errorf("Retryable(%v) = true, want false", err)
		}
	}
}

var counted = inbox.TxOptions{Isolation: sql.LevelReadCommitted, CountAttempt: true}

func testDuplicateReportsStoredPayloadHash(t *testing.T, s inbox.Store) {
	c := claim("m-hash")
	c.PayloadHash = []byte("0123456789abcdef0123456789abcdef")
	committedClaim(t, s, c)
	other := claim("m-hash")
	other.PayloadHash = []byte("ffffffffffffffffffffffffffffffff")
	tx, res := mustClaimResult(t, s, rc, other)
	if res.Claimed || string(res.StoredPayloadHash) != string(c.PayloadHash) {
		t.Fatalf("duplicate: claimed=%v stored hash=%x, want the first claim's hash %x", res.Claimed, res.StoredPayloadHash, c.PayloadHash)
	}
	_ = tx.Rollback(ctxT(t))
	tx, res = mustClaimResult(t, s, rc, claim("m-new-hash"))
	if !res.Claimed || res.StoredPayloadHash != nil {
		t.Fatalf("new claim: %+v, want claimed without a stored hash", res)
	}
	_ = tx.Rollback(ctxT(t))
}

func testAttemptsSurviveRollbacks(t *testing.T, s inbox.Store) {
	for want := 1; want <= 3; want++ {
		tx, res := mustClaimResult(t, s, counted, claim("m-poison"))
		if !res.Claimed || res.Attempt != want || res.DeadLettered {
			t.Fatalf("delivery %d: %+v, want claimed, attempt %d (the count must survive the rollback)", want, res, want)
		}
		if err := tx.Rollback(ctxT(t)); err != nil {
			t.Fatal(err)
		}
	}
	// An uncounted claim (an in-process retry) does not count.
	tx, res := mustClaimResult(t, s, rc, claim("m-poison"))
	if res.Attempt != 0 {
		t.Fatalf("uncounted claim reported attempt %d", res.Attempt)
	}
	_ = tx.Rollback(ctxT(t))
	tx, res = mustClaimResult(t, s, counted, claim("m-poison"))
	if res.Attempt != 4 {
		t.Fatalf("attempt = %d, want 4", res.Attempt)
	}
	_ = tx.Rollback(ctxT(t))
}

func testCommitClearsAttempts(t *testing.T, s inbox.Store) {
	for range 2 {
		tx, _ := mustClaimResult(t, s, counted, claim("m-ok"))
		_ = tx.Rollback(ctxT(t))
	}
	tx, res := mustClaimResult(t, s, counted, claim("m-ok"))
	if res.Attempt != 3 {
		t.Fatalf("attempt = %d, want 3", res.Attempt)
	}
	if err := tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	// A later duplicate starts a fresh count, and committing the duplicate's transaction
	// clears it again: a processed message leaves no attempt record behind.
	for range 2 {
		tx, res = mustClaimResult(t, s, counted, claim("m-ok"))
		if res.Claimed || res.Attempt != 1 {
			t.Fatalf("duplicate after success: %+v, want a duplicate at attempt 1", res)
		}
		if err := tx.Commit(ctxT(t)); err != nil {
			t.Fatal(err)
		}
	}
}

func testDeadLetteredUntilReplay(t *testing.T, s inbox.Store) {
	ctx := ctxT(t)
	tx, _ := mustClaimResult(t, s, counted, claim("m-dead"))
	_ = tx.Rollback(ctx)
	if replayed, err := s.Replay(ctx, "m-dead", "conformance"); err != nil || replayed {
		t.Fatalf("Replay of a key that is not dead-lettered = %v, %v; want false", replayed, err)
	}
	if err := s.MarkDeadLettered(ctx, "m-dead", "conformance", "failed 1 of 1 attempts"); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		tx, res := mustClaimResult(t, s, counted, claim("m-dead"))
		if !res.DeadLettered {
			t.Fatalf("after MarkDeadLettered: %+v, want DeadLettered", res)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
	}
	other := claim("m-dead")
	other.ConsumerName = "other-consumer"
	tx, res := mustClaimResult(t, s, counted, other)
	if res.DeadLettered || res.Attempt != 1 {
		t.Fatalf("another consumer of the same message: %+v, want a fresh attempt 1", res)
	}
	_ = tx.Rollback(ctx)
	if replayed, err := s.Replay(ctx, "m-dead", "conformance"); err != nil || !replayed {
		t.Fatalf("Replay = %v, %v; want true", replayed, err)
	}
	tx, res = mustClaimResult(t, s, counted, claim("m-dead"))
	if res.DeadLettered || res.Attempt != 1 || !res.Claimed {
		t.Fatalf("after Replay: %+v, want a fresh claim at attempt 1", res)
	}
	_ = tx.Rollback(ctx)
	// A message dead-lettered on its first delivery, before any attempt was counted.
	if err := s.MarkDeadLettered(ctx, "m-never-counted", "conformance", "permanent"); err != nil {
		t.Fatal(err)
	}
	tx, res = mustClaimResult(t, s, counted, claim("m-never-counted"))
	if !res.DeadLettered {
		t.Fatalf("dead-lettered without attempts: %+v", res)
	}
	_ = tx.Rollback(ctx)
}

func testRecordFailureAcceptsAnyText(t *testing.T, s inbox.Store) {
	tx, _ := mustClaimResult(t, s, counted, claim("m-err"))
	_ = tx.Rollback(ctxT(t))
	long := make([]byte, 100000)
	for i := range long {
		long[i] = 'e'
	}
	for _, text := range []string{"boom", string(long), "bad \xff utf8 \x00 nul", "é" + string(long)} {
		if err := s.RecordFailure(ctxT(t), "m-err", "conformance", text); err != nil {
			t.Fatalf("RecordFailure(%d bytes): %v", len(text), err)
		}
	}
	// Recording a failure for a key without an attempt record is a no-op, not an error.
	if err := s.RecordFailure(ctxT(t), "m-unknown", "conformance", "boom"); err != nil {
		t.Fatal(err)
	}
}

func testConcurrentCountedClaims(t *testing.T, s inbox.Store) {
	first, res := mustClaimResult(t, s, counted, claim("m-race-counted"))
	if !res.Claimed || res.Attempt != 1 {
		t.Fatalf("first: %+v", res)
	}
	second := claimInBackground(t, s, counted, claim("m-race-counted"))
	expectBlocked(t, second)
	if err := first.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	r := expectResult(t, second)
	if r.err != nil || r.claimed {
		t.Fatalf("second: claimed=%v err=%v, want a duplicate", r.claimed, r.err)
	}
	if err := r.tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
}

func testLockTimeoutEndsTheWait(t *testing.T, s inbox.Store) {
	first, ok := mustClaim(t, s, rc, claim("m-slow"))
	if !ok {
		t.Fatal("first claim refused")
	}
	defer first.Rollback(context.Background())
	opts := inbox.TxOptions{LockTimeout: 150 * time.Millisecond}
	start := time.Now()
	tx, _, err := s.BeginClaim(ctxT(t), opts, claim("m-slow"))
	if err == nil {
		_ = tx.Rollback(context.Background())
		t.Fatal("a claim behind an uncommitted claim did not time out")
	}
	if waited := time.Since(start); waited > 5*time.Second {
		t.Fatalf("the lock wait took %v with a 150ms lock timeout", waited)
	}
	if s.Retryable(err) {
		t.Fatalf("lock timeout reported as Retryable (in-process retry would hold the connection again): %v", err)
	}
}
