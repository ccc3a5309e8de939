// Package storetest is the conformance suite every inbox Store must pass, and MemStore, the
// in-memory reference store that passes it. The inbox's guarantee lives in the store (its
// unique key and its transactions), so a database store runs the suite against the real
// database, never a mock:
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
// allow at least 8 concurrent connections. Stores that implement inbox.AttemptStore,
// inbox.Purger or inbox.BatchStore also run those capabilities' tests.
package storetest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// blockWindow is how long a claim is expected to stay blocked behind an uncommitted claim of
// the same key before the suite releases it.
const blockWindow = 300 * time.Millisecond

type testCase struct {
	name string
	fn   func(t *testing.T, s inbox.Store)
}

// Run runs every conformance test as a subtest of t, each on a new store.
func Run(t *testing.T, newStore func(t *testing.T) inbox.Store) {
	core := []testCase{
		{"FirstClaimWins", testFirstClaimWins},
		{"DuplicateEndsItsTransaction", testDuplicateEndsItsTransaction},
		{"RollbackLeavesNoMark", testRollbackLeavesNoMark},
		{"ConsumerNamesAreIndependent", testConsumerNamesAreIndependent},
		{"ConcurrentClaimWaitsThenSeesDuplicate", testConcurrentClaimWaitsThenSeesDuplicate},
		{"ConcurrentClaimProceedsAfterRollback", testConcurrentClaimProceedsAfterRollback},
		{"DistinctKeysDoNotBlock", testDistinctKeysDoNotBlock},
		{"RepeatableReadConflictIsRetryable", testRepeatableReadConflictIsRetryable},
		{"CancelledContextLeavesNothingOpen", testCancelledContextLeavesNothingOpen},
		{"RetryableRejectsOrdinaryErrors", testRetryableRejectsOrdinaryErrors},
		{"DuplicateReportsStoredPayloadHash", testDuplicateReportsStoredPayloadHash},
		{"UnsupportedIsolationRefused", testUnsupportedIsolationRefused},
	}
	attempts := []struct {
		name string
		fn   func(t *testing.T, s inbox.AttemptStore)
	}{
		{"CountSurvivesRollbacks", testCountSurvivesRollbacks},
		{"CommitClearsTheRecord", testCommitClearsTheRecord},
		{"DuplicateTakesItsCountBack", testDuplicateTakesItsCountBack},
		{"FailRecordsBeforeReleasingTheClaim", testFailRecordsBeforeReleasingTheClaim},
		{"FailCanTakeTheCountBack", testFailCanTakeTheCountBack},
		{"CountedCopiesDoNotInflate", testCountedCopiesDoNotInflate},
		{"CountedCopiesAfterAFailure", testCountedCopiesAfterAFailure},
		{"CountedCopyBehindAnUncountedClaim", testCountedCopyBehindAnUncountedClaim},
		{"DeadLetteredUntilReplay", testDeadLetteredUntilReplay},
		{"AdjustAttempts", testAdjustAttempts},
		{"CountLimitStopsCounting", testCountLimitStopsCounting},
		{"NoRecordClaimsAlone", testNoRecordClaimsAlone},
	}
	for _, tc := range core {
		t.Run(tc.name, func(t *testing.T) { tc.fn(t, newStore(t)) })
	}
	for _, tc := range attempts {
		t.Run("Attempts/"+tc.name, func(t *testing.T) {
			as, ok := newStore(t).(inbox.AttemptStore)
			if !ok {
				t.Skip("the store does not implement inbox.AttemptStore")
			}
			tc.fn(t, as)
		})
	}
	t.Run("Purger/PurgeDeletesOnlyOldRows", func(t *testing.T) {
		s := newStore(t)
		if _, ok := s.(inbox.Purger); !ok {
			t.Skip("the store does not implement inbox.Purger")
		}
		testPurge(t, s)
	})
	runBatch(t, newStore)
}

func params(id string) inbox.ClaimParams {
	return inbox.ClaimParams{
		Key:         inbox.Key{MessageID: id, ConsumerName: "conformance"},
		Isolation:   sql.LevelReadCommitted,
		MessageType: "Test", CorrelationID: "corr-1", PayloadHash: make([]byte, 32),
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// mustClaim claims p and returns the transaction (nil for a duplicate) and the result.
func mustClaim(t *testing.T, s inbox.Store, p inbox.ClaimParams) (inbox.Tx, inbox.ClaimResult) {
	t.Helper()
	tx, res, err := s.Claim(ctxT(t), p)
	if err != nil {
		t.Fatalf("Claim(%q, %q): %v", p.Key.MessageID, p.Key.ConsumerName, err)
	}
	if res.Claimed != (tx != nil) {
		t.Fatalf("Claim(%q): claimed=%v but tx=%v; a new claim returns a Tx, a duplicate none", p.Key.MessageID, res.Claimed, tx)
	}
	if tx != nil {
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	}
	return tx, res
}

// committedClaim claims and commits p, returning whether the claim was new.
func committedClaim(t *testing.T, s inbox.Store, p inbox.ClaimParams) bool {
	t.Helper()
	tx, res := mustClaim(t, s, p)
	if tx == nil {
		return false
	}
	if err := tx.Commit(ctxT(t)); err != nil {
		t.Fatalf("Commit after claim of %q: %v", p.Key.MessageID, err)
	}
	return res.Claimed
}

func testFirstClaimWins(t *testing.T, s inbox.Store) {
	if !committedClaim(t, s, params("m-1")) {
		t.Fatal("first claim of m-1 reported a duplicate on empty storage")
	}
	for i := range 3 {
		if committedClaim(t, s, params("m-1")) {
			t.Fatalf("claim %d of committed m-1 was accepted again", i+2)
		}
	}
}

func testDuplicateEndsItsTransaction(t *testing.T, s inbox.Store) {
	committedClaim(t, s, params("m-dup"))
	// Many duplicates in a row: each must end its own transaction (release its connection),
	// or a store with a bounded pool runs out.
	for range 20 {
		if tx, res := mustClaim(t, s, params("m-dup")); tx != nil || res.Claimed {
			t.Fatal("duplicate claim accepted")
		}
	}
	if !committedClaim(t, s, params("m-after-dup")) {
		t.Fatal("claim after duplicates was refused")
	}
}

func testRollbackLeavesNoMark(t *testing.T, s inbox.Store) {
	tx, res := mustClaim(t, s, params("m-rb"))
	if !res.Claimed {
		t.Fatal("first claim refused")
	}
	if err := tx.Rollback(ctxT(t)); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	if err := tx.Rollback(ctxT(t)); err != nil {
		t.Fatalf("second Rollback must be a no-op, got %v", err)
	}
	if !committedClaim(t, s, params("m-rb")) {
		t.Fatal("a rolled-back claim left a processed mark: the redelivery was treated as a duplicate")
	}
}

func testConsumerNamesAreIndependent(t *testing.T, s inbox.Store) {
	a := params("m-shared")
	a.Key.ConsumerName = "billing"
	b := params("m-shared")
	b.Key.ConsumerName = "notifications"
	txA, resA := mustClaim(t, s, a)
	// B must not wait on A's uncommitted claim: a different consumer is a different key.
	done := make(chan bool, 1)
	go func() {
		tx, res, err := s.Claim(ctxT(t), b)
		if err != nil {
			t.Errorf("claim for second consumer: %v", err)
			done <- false
			return
		}
		if tx != nil {
			if err := tx.Commit(context.Background()); err != nil {
				t.Errorf("commit for second consumer: %v", err)
			}
		}
		done <- res.Claimed
	}()
	select {
	case okB := <-done:
		if !resA.Claimed || !okB {
			t.Fatalf("claims for two consumers of one message: billing=%v notifications=%v, want both true", resA.Claimed, okB)
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

type claimOutcome struct {
	tx  inbox.Tx
	res inbox.ClaimResult
	rec inbox.AttemptRecord
	err error
}

// claimInBackground starts a claim of p and returns its result channel.
func claimInBackground(t *testing.T, s inbox.Store, p inbox.ClaimParams) <-chan claimOutcome {
	ch := make(chan claimOutcome, 1)
	go func() {
		tx, res, err := s.Claim(ctxT(t), p)
		ch <- claimOutcome{tx: tx, res: res, err: err}
	}()
	return ch
}

func countedInBackground(t *testing.T, s inbox.AttemptStore, p inbox.ClaimParams, first bool) <-chan claimOutcome {
	ch := make(chan claimOutcome, 1)
	go func() {
		tx, res, err := s.ClaimCounted(ctxT(t), inbox.CountedClaimParams{ClaimParams: p, CountFirst: first})
		o := claimOutcome{res: res.ClaimResult, rec: res.Record, err: err}
		if tx != nil {
			o.tx = tx
		}
		ch <- o
	}()
	return ch
}

func expectBlocked(t *testing.T, ch <-chan claimOutcome) {
	t.Helper()
	select {
	case r := <-ch:
		t.Fatalf("a concurrent claim of an uncommitted key returned at once (claimed=%v err=%v); it must wait on the first transaction", r.res.Claimed, r.err)
	case <-time.After(blockWindow):
	}
}

func expectResult(t *testing.T, ch <-chan claimOutcome) claimOutcome {
	t.Helper()
	select {
	case r := <-ch:
		if r.tx != nil {
			t.Cleanup(func() { _ = r.tx.Rollback(context.Background()) })
		}
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("a blocked claim did not return after the first transaction ended")
		return claimOutcome{}
	}
}

func testConcurrentClaimWaitsThenSeesDuplicate(t *testing.T, s inbox.Store) {
	first, res := mustClaim(t, s, params("m-race"))
	if !res.Claimed {
		t.Fatal("first claim refused")
	}
	second := claimInBackground(t, s, params("m-race"))
	expectBlocked(t, second)
	if err := first.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	r := expectResult(t, second)
	if r.err != nil {
		t.Fatalf("blocked claim ended with an error after the first committed: %v (want a duplicate, not a unique violation)", r.err)
	}
	if r.res.Claimed || r.tx != nil {
		t.Fatal("both concurrent claims of one key were accepted")
	}
}

func testConcurrentClaimProceedsAfterRollback(t *testing.T, s inbox.Store) {
	first, res := mustClaim(t, s, params("m-race-rb"))
	if !res.Claimed {
		t.Fatal("first claim refused")
	}
	second := claimInBackground(t, s, params("m-race-rb"))
	expectBlocked(t, second)
	if err := first.Rollback(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	r := expectResult(t, second)
	if r.err != nil || !r.res.Claimed {
		t.Fatalf("after the first claim rolled back the waiting claim got claimed=%v err=%v, want claimed", r.res.Claimed, r.err)
	}
	if err := r.tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if committedClaim(t, s, params("m-race-rb")) {
		t.Fatal("claim accepted again after the second transaction committed")
	}
}

func testDistinctKeysDoNotBlock(t *testing.T, s inbox.Store) {
	if _, res := mustClaim(t, s, params("m-a")); !res.Claimed {
		t.Fatal("claim refused")
	}
	r := claimInBackground(t, s, params("m-b"))
	select {
	case res := <-r:
		if res.err != nil || !res.res.Claimed {
			t.Fatalf("claim of another key: claimed=%v err=%v", res.res.Claimed, res.err)
		}
		_ = res.tx.Rollback(context.Background())
	case <-time.After(5 * time.Second):
		t.Fatal("a claim of a different key blocked on an uncommitted claim")
	}
}

func testRepeatableReadConflictIsRetryable(t *testing.T, s inbox.Store) {
	rr := params("m-rr")
	rr.Isolation = sql.LevelRepeatableRead
	first, res := mustClaim(t, s, rr)
	if !res.Claimed {
		t.Fatal("first claim refused")
	}
	second := claimInBackground(t, s, rr)
	expectBlocked(t, second)
	if err := first.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	r := expectResult(t, second)
	switch {
	case r.err != nil && s.Retryable(r.err):
		// The conflicting row was committed after this transaction's snapshot: a
		// serialization failure, to be retried as a whole.
	case r.err == nil && !r.res.Claimed:
		// Also acceptable: the store resolved it as a duplicate.
	default:
		t.Fatalf("concurrent REPEATABLE READ claim: claimed=%v err=%v retryable=%v; want a retryable error or a duplicate", r.res.Claimed, r.err, r.err != nil && s.Retryable(r.err))
	}
	// The retry in a fresh transaction sees the committed row.
	if committedClaim(t, s, rr) {
		t.Fatal("retry of the REPEATABLE READ conflict was accepted as new")
	}
}

func testCancelledContextLeavesNothingOpen(t *testing.T, s inbox.Store) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if tx, _, err := s.Claim(ctx, params("m-cancel")); err == nil {
		if tx != nil {
			_ = tx.Rollback(context.Background())
		}
		t.Fatal("Claim with a cancelled context succeeded")
	}
	if !committedClaim(t, s, params("m-cancel")) {
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

func testDuplicateReportsStoredPayloadHash(t *testing.T, s inbox.Store) {
	p := params("m-hash")
	p.PayloadHash = []byte("0123456789abcdef0123456789abcdef")
	committedClaim(t, s, p)
	other := params("m-hash")
	other.PayloadHash = []byte("ffffffffffffffffffffffffffffffff")
	_, res := mustClaim(t, s, other)
	// A store may keep a prefix of the hash (at least 2 bytes, as pgstore's compact layout):
	// ClaimResult.StoredPayloadHash. It must still tell this other payload apart.
	if res.Claimed || len(res.StoredPayloadHash) < 2 || strings.HasPrefix(string(other.PayloadHash), string(res.StoredPayloadHash)) || !strings.HasPrefix(string(p.PayloadHash), string(res.StoredPayloadHash)) {
		t.Fatalf("duplicate: claimed=%v stored hash=%x, want the first claim's hash %x (or a prefix of at least 2 bytes that the other payload's hash does not share)", res.Claimed, res.StoredPayloadHash, p.PayloadHash)
	}
	tx, res := mustClaim(t, s, params("m-new-hash"))
	if !res.Claimed || res.StoredPayloadHash != nil {
		t.Fatalf("new claim: %+v, want claimed without a stored hash", res)
	}
	_ = tx.Rollback(ctxT(t))
}

func testUnsupportedIsolationRefused(t *testing.T, s inbox.Store) {
	p := params("m-iso")
	p.Isolation = sql.LevelLinearizable
	if tx, _, err := s.Claim(ctxT(t), p); !errors.Is(err, inbox.ErrInvalidConfig) {
		if tx != nil {
			_ = tx.Rollback(context.Background())
		}
		t.Fatalf("Claim at LINEARIZABLE: %v, want ErrInvalidConfig", err)
	}
}

// counted claims p with ClaimCounted and fails the test on error.
func counted(t *testing.T, s inbox.AttemptStore, p inbox.ClaimParams, first bool) (inbox.CountedTx, inbox.CountedClaimResult) {
	t.Helper()
	tx, res, err := s.ClaimCounted(ctxT(t), inbox.CountedClaimParams{ClaimParams: p, CountFirst: first})
	if err != nil {
		t.Fatalf("ClaimCounted(%q): %v", p.Key.MessageID, err)
	}
	if tx != nil {
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	}
	return tx, res
}

// attemptsOf reads the key's attempt count (AdjustAttempts with delta 0).
func attemptsOf(t *testing.T, s inbox.AttemptStore, id string) int {
	t.Helper()
	n, err := s.AdjustAttempts(ctxT(t), inbox.AttemptParams{Key: params(id).Key})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func testCountSurvivesRollbacks(t *testing.T, s inbox.AttemptStore) {
	for want := 1; want <= 3; want++ {
		tx, res := counted(t, s, params("m-poison"), true)
		if !res.Claimed || !res.Counted || res.Record.Attempts != want || res.Record.DeadLettered {
			t.Fatalf("delivery %d: %+v, want claimed, counted, attempts %d (the count must survive the rollback)", want, res, want)
		}
		if err := tx.Rollback(ctxT(t)); err != nil {
			t.Fatal(err)
		}
	}
	// A claim that does not count first leaves the count as it is.
	tx, res := counted(t, s, params("m-poison"), false)
	if res.Counted || res.Record.Attempts != 3 {
		t.Fatalf("uncounted claim: %+v, want attempts 3 and not counted", res)
	}
	_ = tx.Rollback(ctxT(t))
	if n := attemptsOf(t, s, "m-poison"); n != 3 {
		t.Fatalf("attempts after rollbacks = %d, want 3", n)
	}
}

// testCountLimitStopsCounting: a delivery that counts first with CountLimit n is not counted
// once the record holds n attempts (its attempts are used up: it will not run the handler), so
// the record never shows more attempts than deliveries that may have run it. Without a limit it
// is counted.
func testCountLimitStopsCounting(t *testing.T, s inbox.AttemptStore) {
	const limit = 2
	claim := func(first bool, limit int) inbox.CountedClaimResult {
		t.Helper()
		tx, res, err := s.ClaimCounted(ctxT(t), inbox.CountedClaimParams{ClaimParams: params("m-limit"), CountFirst: first, CountLimit: limit})
		if err != nil {
			t.Fatalf("ClaimCounted: %v", err)
		}
		if tx != nil {
			if err := tx.Rollback(ctxT(t)); err != nil {
				t.Fatal(err)
			}
		}
		return res
	}
	for want := 1; want <= limit; want++ {
		if res := claim(true, limit); !res.Claimed || !res.Counted || res.Record.Attempts != want {
			t.Fatalf("delivery %d under the limit: %+v, want claimed and counted, attempts %d", want, res, want)
		}
	}
	for range 3 {
		if res := claim(true, limit); !res.Claimed || res.Counted || res.Record.Attempts != limit {
			t.Fatalf("delivery at the limit: %+v, want claimed, not counted, attempts %d", res, limit)
		}
		if n := attemptsOf(t, s, "m-limit"); n != limit {
			t.Fatalf("attempts after a delivery at the limit = %d, want %d", n, limit)
		}
	}
	if res := claim(true, 0); !res.Counted || res.Record.Attempts != limit+1 {
		t.Fatalf("delivery without a limit: %+v, want counted, attempts %d", res, limit+1)
	}
}

func testCommitClearsTheRecord(t *testing.T, s inbox.AttemptStore) {
	for range 2 {
		tx, _ := counted(t, s, params("m-ok"), true)
		_ = tx.Rollback(ctxT(t))
	}
	tx, res := counted(t, s, params("m-ok"), true)
	if res.Record.Attempts != 3 {
		t.Fatalf("attempts = %d, want 3", res.Record.Attempts)
	}
	if err := tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if n := attemptsOf(t, s, "m-ok"); n != 0 {
		t.Fatalf("a processed message keeps an attempt record of %d", n)
	}
}

func testDuplicateTakesItsCountBack(t *testing.T, s inbox.AttemptStore) {
	committedClaim(t, s, params("m-done"))
	for range 3 {
		tx, res := counted(t, s, params("m-done"), true)
		if tx != nil || res.Claimed {
			t.Fatal("a processed key was claimed again")
		}
	}
	if n := attemptsOf(t, s, "m-done"); n != 0 {
		t.Fatalf("duplicates left an attempt record of %d", n)
	}
	if n, err := s.AdjustAttempts(ctxT(t), inbox.AttemptParams{Key: params("m-done").Key, AttemptsDelta: 1, Error: "late"}); err != nil || n != 0 {
		t.Fatalf("AdjustAttempts(+1) on a processed key = %d, %v; want 0: no record for a processed message", n, err)
	}
}

func testFailRecordsBeforeReleasingTheClaim(t *testing.T, s inbox.AttemptStore) {
	tx, res := counted(t, s, params("m-fail"), false)
	if !res.Claimed || res.Counted {
		t.Fatalf("%+v", res)
	}
	copyCh := countedInBackground(t, s, params("m-fail"), false)
	expectBlocked(t, copyCh)
	n, err := tx.Fail(ctxT(t), inbox.FailParams{AttemptsDelta: 1, Error: "boom"})
	if err != nil || n != 1 {
		t.Fatalf("Fail = %d, %v; want 1", n, err)
	}
	r := expectResult(t, copyCh)
	if r.err != nil || !r.res.Claimed || r.rec.Attempts != 1 || r.rec.LastError != "boom" {
		t.Fatalf("the copy waiting on the claim: %+v err=%v, want claimed with attempts 1 and last error boom", r.rec, r.err)
	}
	// The copy fails too, with the count it read: 2.
	n, err = r.tx.(inbox.CountedTx).Fail(ctxT(t), inbox.FailParams{AttemptsDelta: 1, Error: "boom again"})
	if err != nil || n != 2 {
		t.Fatalf("second Fail = %d, %v; want 2", n, err)
	}
	if !committedClaim(t, s, params("m-fail")) {
		t.Fatal("Fail left the claim committed: the message counts as processed")
	}
}

func testFailCanTakeTheCountBack(t *testing.T, s inbox.AttemptStore) {
	tx, res := counted(t, s, params("m-abandon"), true)
	if !res.Counted || res.Record.Attempts != 1 {
		t.Fatalf("%+v", res)
	}
	if n, err := tx.Fail(ctxT(t), inbox.FailParams{AttemptsDelta: -1}); err != nil || n != 0 {
		t.Fatalf("Fail(-1) = %d, %v; want 0", n, err)
	}
	if n := attemptsOf(t, s, "m-abandon"); n != 0 {
		t.Fatalf("attempts after taking the count back = %d, want 0", n)
	}
}

func testCountedCopiesDoNotInflate(t *testing.T, s inbox.AttemptStore) {
	first, res := counted(t, s, params("m-copies"), true)
	if !res.Counted || res.Record.Attempts != 1 {
		t.Fatalf("%+v", res)
	}
	var copies []<-chan claimOutcome
	for range 5 {
		copies = append(copies, countedInBackground(t, s, params("m-copies"), true))
	}
	for _, c := range copies {
		expectBlocked(t, c)
	}
	if err := first.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	for _, c := range copies {
		if r := expectResult(t, c); r.err != nil || r.res.Claimed {
			t.Fatalf("copy after the commit: claimed=%v err=%v, want a duplicate", r.res.Claimed, r.err)
		}
	}
	if n := attemptsOf(t, s, "m-copies"); n != 0 {
		t.Fatalf("copies waiting behind a successful delivery left %d attempts", n)
	}
}

func testCountedCopiesAfterAFailure(t *testing.T, s inbox.AttemptStore) {
	first, _ := counted(t, s, params("m-copies-fail"), true)
	var copies []<-chan claimOutcome
	for range 3 {
		copies = append(copies, countedInBackground(t, s, params("m-copies-fail"), true))
	}
	for _, c := range copies {
		expectBlocked(t, c)
	}
	if n, err := first.Fail(ctxT(t), inbox.FailParams{Error: "boom"}); err != nil || n != 1 {
		t.Fatalf("Fail = %d, %v; want 1", n, err)
	}
	// Exactly one copy claims, counted once more; the others wait until it commits and then
	// find a duplicate. Nothing counts a delivery that did not run the handler.
	var winner claimOutcome
	pending := copies
	deadline := time.After(10 * time.Second)
	for winner.tx == nil {
		for i, c := range pending {
			select {
			case r := <-c:
				if r.err != nil || !r.res.Claimed {
					t.Fatalf("a copy after a failure: claimed=%v err=%v", r.res.Claimed, r.err)
				}
				winner = r
				pending = append(pending[:i:i], pending[i+1:]...)
			default:
				continue
			}
			break
		}
		select {
		case <-deadline:
			t.Fatal("no copy claimed after the failure")
		case <-time.After(10 * time.Millisecond):
		}
	}
	if winner.rec.Attempts != 2 || winner.rec.LastError != "boom" {
		t.Fatalf("winning copy read %+v, want attempts 2 (the failure and itself) and last error boom", winner.rec)
	}
	if err := winner.tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	for _, c := range pending {
		if r := expectResult(t, c); r.err != nil || r.res.Claimed {
			t.Fatalf("copy after the commit: claimed=%v err=%v", r.res.Claimed, r.err)
		}
	}
	if n := attemptsOf(t, s, "m-copies-fail"); n != 0 {
		t.Fatalf("attempt record left after processing: %d", n)
	}
}

// testCountedCopyBehindAnUncountedClaim: a delivery that does not count first (a first
// delivery, by the broker's signal) holds the claim; a copy that counts first arrives. The
// copy must not be counted while the first runs (its count would be taken for a failure by
// the first delivery's Fail, and dead-letter the message early): the first's Fail reports its
// own failure only, and the copy then claims, counted, reading both.
func testCountedCopyBehindAnUncountedClaim(t *testing.T, s inbox.AttemptStore) {
	first, res := counted(t, s, params("m-behind-first"), false)
	if !res.Claimed || res.Counted {
		t.Fatalf("%+v", res)
	}
	copyCh := countedInBackground(t, s, params("m-behind-first"), true)
	expectBlocked(t, copyCh)
	if n := attemptsOf(t, s, "m-behind-first"); n != 0 {
		t.Fatalf("a copy waiting behind an uncounted delivery was counted (%d) while that delivery runs", n)
	}
	if n, err := first.Fail(ctxT(t), inbox.FailParams{AttemptsDelta: 1, Error: "boom"}); err != nil || n != 1 {
		t.Fatalf("the first delivery's Fail = %d, %v; want 1: its own failure, not a waiting copy's count", n, err)
	}
	r := expectResult(t, copyCh)
	if r.err != nil || !r.res.Claimed || r.rec.Attempts != 2 || r.rec.LastError != "boom" {
		t.Fatalf("the copy: claimed=%v rec=%+v err=%v; want claimed, attempts 2 (the failure and itself)", r.res.Claimed, r.rec, r.err)
	}
	if err := r.tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if n := attemptsOf(t, s, "m-behind-first"); n != 0 {
		t.Fatalf("attempt record left after processing: %d", n)
	}
}

func testDeadLetteredUntilReplay(t *testing.T, s inbox.AttemptStore) {
	ctx := ctxT(t)
	key := params("m-dead").Key
	tx, _ := counted(t, s, params("m-dead"), true)
	_ = tx.Rollback(ctx)
	if replayed, err := s.Replay(ctx, inbox.AttemptParams{Key: key}); err != nil || replayed {
		t.Fatalf("Replay of a key that is not dead-lettered = %v, %v; want false", replayed, err)
	}
	if err := s.MarkDeadLettered(ctx, inbox.AttemptParams{Key: key, Error: "failed 1 of 1 attempts"}); err != nil {
		t.Fatal(err)
	}
	for _, first := range []bool{true, false} {
		tx, res := counted(t, s, params("m-dead"), first)
		if tx != nil || res.Claimed || !res.Record.DeadLettered || res.Record.DeadLetterReason != "failed 1 of 1 attempts" {
			t.Fatalf("after MarkDeadLettered: %+v, want not claimed, dead-lettered with its reason", res)
		}
	}
	other := params("m-dead")
	other.Key.ConsumerName = "other-consumer"
	tx, res := counted(t, s, other, true)
	if res.Record.DeadLettered || res.Record.Attempts != 1 || !res.Claimed {
		t.Fatalf("another consumer of the same message: %+v, want a fresh attempt 1", res)
	}
	_ = tx.Rollback(ctx)
	if replayed, err := s.Replay(ctx, inbox.AttemptParams{Key: key}); err != nil || !replayed {
		t.Fatalf("Replay = %v, %v; want true", replayed, err)
	}
	tx, res = counted(t, s, params("m-dead"), true)
	if res.Record.DeadLettered || res.Record.Attempts != 1 || !res.Claimed {
		t.Fatalf("after Replay: %+v, want a fresh claim at attempt 1", res)
	}
	_ = tx.Rollback(ctx)
	// A message dead-lettered on its first delivery, before any attempt was counted.
	never := params("m-never-counted")
	if err := s.MarkDeadLettered(ctx, inbox.AttemptParams{Key: never.Key, Error: "permanent"}); err != nil {
		t.Fatal(err)
	}
	if _, res := counted(t, s, never, false); !res.Record.DeadLettered {
		t.Fatalf("dead-lettered without attempts: %+v", res)
	}
}

// testNoRecordClaimsAlone: a claim with NoRecord (a first delivery) neither reads nor
// clears the key's attempt record: Record is zero, a dead-lettered key is claimed, and a
// Fail of it counts nothing (0) and leaves the record dead-lettered, while a commit of it
// makes the dead letter moot (Replay refuses it); a commit leaves another copy's record,
// which that copy's duplicate claim clears. Positive counts of a processed or
// dead-lettered key return 0.
func testNoRecordClaimsAlone(t *testing.T, s inbox.AttemptStore) {
	ctx := ctxT(t)
	noRecord := func(p inbox.ClaimParams) (inbox.CountedTx, inbox.CountedClaimResult) {
		t.Helper()
		tx, res, err := s.ClaimCounted(ctx, inbox.CountedClaimParams{ClaimParams: p, NoRecord: true})
		if err != nil {
			t.Fatalf("ClaimCounted(%q, NoRecord): %v", p.Key.MessageID, err)
		}
		if tx != nil {
			t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		}
		return tx, res
	}
	dead := params("m-norecord-dead")
	if err := s.MarkDeadLettered(ctx, inbox.AttemptParams{Key: dead.Key, Error: "permanent"}); err != nil {
		t.Fatal(err)
	}
	tx, res := noRecord(dead)
	if tx == nil || !res.Claimed || res.Record != (inbox.AttemptRecord{}) {
		t.Fatalf("NoRecord claim of a dead-lettered key: %+v, want claimed with a zero record", res)
	}
	if n, err := tx.Fail(ctx, inbox.FailParams{AttemptsDelta: 1, Error: "boom"}); err != nil || n != 0 {
		t.Fatalf("Fail(+1) of a dead-lettered key = %d, %v; want 0", n, err)
	}
	if _, res := counted(t, s, dead, false); !res.Record.DeadLettered || res.Record.Attempts != 0 || res.Record.LastError != "" {
		t.Fatalf("after the NoRecord copy failed: %+v, want the dead-lettered record unchanged", res)
	}
	// A NoRecord copy of it that succeeds processes the key: the dead letter is moot, and
	// Replay refuses it (false) and deletes it.
	tx, res = noRecord(dead)
	if !res.Claimed {
		t.Fatalf("second NoRecord claim of a dead-lettered key: %+v, want claimed", res)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if ok, err := s.Replay(ctx, inbox.AttemptParams{Key: dead.Key}); err != nil || ok {
		t.Fatalf("Replay of a dead letter processed since = %v, %v; want false", ok, err)
	}
	if ok, err := s.Replay(ctx, inbox.AttemptParams{Key: dead.Key}); err != nil || ok {
		t.Fatalf("second Replay = %v, %v; want false (the moot record is gone)", ok, err)
	}

	pending := params("m-norecord-pending")
	if n, err := s.AdjustAttempts(ctx, inbox.AttemptParams{Key: pending.Key, AttemptsDelta: 1, Error: "timeout"}); err != nil || n != 1 {
		t.Fatalf("AdjustAttempts(+1) = %d, %v", n, err)
	}
	tx, res = noRecord(pending)
	if !res.Claimed || res.Record != (inbox.AttemptRecord{}) {
		t.Fatalf("NoRecord claim of a key with a record: %+v, want claimed with a zero record", res)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := s.AdjustAttempts(ctx, inbox.AttemptParams{Key: pending.Key, AttemptsDelta: 1}); err != nil || n != 0 {
		t.Fatalf("AdjustAttempts(+1) of a processed key = %d, %v; want 0", n, err)
	}
	if n := attemptsOf(t, s, "m-norecord-pending"); n != 1 {
		t.Fatalf("after a NoRecord commit the other copy's record holds %d attempts, want 1 (left to that copy)", n)
	}
	if tx, res := counted(t, s, pending, true); tx != nil || res.Claimed {
		t.Fatalf("the other copy's redelivery: %+v, want a duplicate", res)
	}
	if n := attemptsOf(t, s, "m-norecord-pending"); n != 0 {
		t.Fatalf("after the other copy's duplicate claim the record holds %d attempts, want none", n)
	}
}

func testAdjustAttempts(t *testing.T, s inbox.AttemptStore) {
	key := params("m-adj").Key
	long := strings.Repeat("e", 100000)
	for i, text := range []string{"boom", long, "bad \xff utf8 \x00 nul", "é" + long} {
		n, err := s.AdjustAttempts(ctxT(t), inbox.AttemptParams{Key: key, AttemptsDelta: 1, Error: text})
		if err != nil || n != i+1 {
			t.Fatalf("AdjustAttempts(+1, %d bytes) = %d, %v; want %d", len(text), n, err, i+1)
		}
	}
	if n, err := s.AdjustAttempts(ctxT(t), inbox.AttemptParams{Key: key, AttemptsDelta: -10}); err != nil || n != 0 {
		t.Fatalf("AdjustAttempts(-10) = %d, %v; want 0 (never negative)", n, err)
	}
	if n, err := s.AdjustAttempts(ctxT(t), inbox.AttemptParams{Key: params("m-unknown").Key, AttemptsDelta: -1}); err != nil || n != 0 {
		t.Fatalf("AdjustAttempts(-1) of an unknown key = %d, %v; want 0 and no error", n, err)
	}
}

func testPurge(t *testing.T, s inbox.Store) {
	p := s.(inbox.Purger)
	for i := range 7 {
		committedClaim(t, s, params(fmt.Sprintf("m-purge-%d", i)))
	}
	res, err := p.Purge(ctxT(t), inbox.PurgeParams{Before: time.Now().Add(-time.Hour), BatchSize: 3})
	if err != nil || res.Deleted != 0 {
		t.Fatalf("Purge before an hour ago = %+v, %v; want nothing deleted (the rows are new)", res, err)
	}
	res, err = p.Purge(ctxT(t), inbox.PurgeParams{Before: time.Now().Add(time.Minute), BatchSize: 3})
	if err != nil || res.Deleted != 7 || res.Batches != 3 {
		t.Fatalf("Purge of everything in batches of 3 = %+v, %v; want 7 rows in 3 batches", res, err)
	}
	// A purged key is new again: the reason the retention window must outlast redelivery.
	if !committedClaim(t, s, params("m-purge-0")) {
		t.Fatal("a purged key was still seen as processed")
	}
}
