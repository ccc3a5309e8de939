// Package storetest is the conformance suite of the inbox's storage contract
// (internal/contract), and MemStore, the in-memory reference store that passes it. The
// inbox's guarantee lives in the store (its unique key and its transactions), so a database
// store runs the suite against the real database, never a mock:
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, storetest.Harness{New: freshMigratedStore, Record: readAttemptsRow})
//	}
//
// New must return a store on empty, migrated storage for each call, whose pool allows at
// least 6 concurrent connections. The suite observes a store through the contract (what a
// later claim of a key decides) and through Record, which reads a key's attempt record from
// the storage itself.
package storetest

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
)

// blockWindow is how long a claim is expected to stay blocked behind an uncommitted claim of
// the same key before the suite releases it.
const blockWindow = 300 * time.Millisecond

// Harness is what the suite needs of a store under test.
type Harness struct {
	// New returns a store on empty, migrated storage.
	New func(t *testing.T) contract.Store
	// Record reads k's attempt record from s's storage: the attempt count, and false when
	// there is no record.
	Record func(t *testing.T, s contract.Store, k contract.Key) (attempts int, ok bool)
}

// record is the Harness's Record for the test that runs.
var record func(t *testing.T, s contract.Store, k contract.Key) (int, bool)

type testCase struct {
	name string
	fn   func(t *testing.T, s contract.Store)
}

// Run runs every conformance test as a subtest of t, each on a new store.
func Run(t *testing.T, h Harness) {
	record = h.Record
	for _, tc := range []testCase{
		{"FirstClaimWins", testFirstClaimWins},
		{"FailLeavesNoMark", testFailLeavesNoMark},
		{"ConsumerNamesAreIndependent", testConsumerNamesAreIndependent},
		{"ConcurrentClaimWaitsThenSeesDuplicate", testConcurrentClaimWaitsThenSeesDuplicate},
		{"ConcurrentClaimProceedsAfterFail", testConcurrentClaimProceedsAfterFail},
		{"DistinctKeysDoNotBlock", testDistinctKeysDoNotBlock},
		{"CancelledClaimLeavesNothingOpen", testCancelledClaimLeavesNothingOpen},
		{"OtherPayloadIsACollision", testOtherPayloadIsACollision},
		{"UnsupportedIsolationRefused", testUnsupportedIsolationRefused},
		{"OrdinaryErrorsAreOther", testOrdinaryErrorsAreOther},
		{"Attempts/CountFirstSurvivesTheRollback", testCountFirstSurvivesTheRollback},
		{"Attempts/FirstDeliveryCountsOnlyItsFailure", testFirstDeliveryCountsOnlyItsFailure},
		{"Attempts/NotTheMessagesFaultTakesTheCountBack", testNotTheMessagesFaultTakesTheCountBack},
		{"Attempts/ExhaustedAfterMaxAttempts", testExhaustedAfterMaxAttempts},
		{"Attempts/CommitClearsTheRecord", testCommitClearsTheRecord},
		{"Attempts/WaitingCopyIsNotCounted", testWaitingCopyIsNotCounted},
		{"Attempts/UnsettledAttemptsRunAlone", testUnsettledAttemptsRunAlone},
		{"Attempts/DeadLetteredUntilReplay", testDeadLetteredUntilReplay},
		{"Batch/ClaimsEachKeyOnce", testBatchClaimsEachKeyOnce},
		{"Batch/DropRollsBackOnlyThatMember", testBatchDropRollsBackOnlyThatMember},
		{"Batch/RollbackLeavesNoMark", testBatchRollbackLeavesNoMark},
		{"Batch/HeldKeyRunsAlone", testBatchHeldKeyRunsAlone},
		{"Batch/CountsAndClears", testBatchCountsAndClears},
		{"Batch/DeadLetteredIsNotClaimed", testBatchDeadLetteredIsNotClaimed},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.fn(t, h.New(t)) })
	}
}

// delivery returns a delivery of message id for consumer "c" with payload "p".
func delivery(id string) contract.Delivery {
	h := sha256.Sum256([]byte("p"))
	return contract.Delivery{Key: contract.Key{MessageID: id, ConsumerName: "c"}, PayloadHash: h[:]}
}

// counted is delivery with attempt counting (MaxAttempts 3), counted first when first.
func counted(id string, first bool) contract.Delivery {
	d := delivery(id)
	d.MaxAttempts, d.CountFirst = 3, first
	return d
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// claim claims d and expects decision want; it returns the Tx (for Run) and the claim.
func claim(t *testing.T, s contract.Store, d contract.Delivery, want contract.Decision) (contract.Tx, contract.Claim) {
	t.Helper()
	tx, c, err := s.Claim(ctxT(t), d)
	if err != nil {
		t.Fatalf("claim %s: %v", d.Key.MessageID, err)
	}
	if c.Decision != want {
		t.Fatalf("claim %s: decision %d, want %d (%+v)", d.Key.MessageID, c.Decision, want, c)
	}
	if (tx != nil) != (want == contract.Run) {
		t.Fatalf("claim %s: decision %d with Tx %v", d.Key.MessageID, c.Decision, tx != nil)
	}
	return tx, c
}

func commit(t *testing.T, tx contract.Tx) {
	t.Helper()
	if err := tx.Commit(ctxT(t)); err != nil {
		t.Fatalf("commit: %v", err)
	}
}

func fail(t *testing.T, tx contract.Tx, f contract.Failure) int {
	t.Helper()
	n, err := tx.Fail(ctxT(t), f)
	if err != nil {
		t.Fatalf("fail: %v", err)
	}
	return n
}

func testFirstClaimWins(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, delivery("m1"), contract.Run)
	commit(t, tx)
	claim(t, s, delivery("m1"), contract.Duplicate)
	claim(t, s, delivery("m1"), contract.Duplicate) // a duplicate ended its own transaction
}

func testFailLeavesNoMark(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, delivery("m1"), contract.Run)
	fail(t, tx, contract.Failure{Counts: true, Error: "boom"})
	tx, _ = claim(t, s, delivery("m1"), contract.Run)
	commit(t, tx)
	claim(t, s, delivery("m1"), contract.Duplicate)
}

func testConsumerNamesAreIndependent(t *testing.T, s contract.Store) {
	a := delivery("m1")
	b := a
	b.Key.ConsumerName = "other"
	txA, _ := claim(t, s, a, contract.Run)
	txB, _ := claim(t, s, b, contract.Run) // does not wait for a's open claim
	commit(t, txA)
	commit(t, txB)
	claim(t, s, a, contract.Duplicate)
	claim(t, s, b, contract.Duplicate)
}

type claimOutcome struct {
	tx  contract.Tx
	c   contract.Claim
	err error
}

func claimInBackground(t *testing.T, s contract.Store, d contract.Delivery) <-chan claimOutcome {
	ch := make(chan claimOutcome, 1)
	go func() {
		tx, c, err := s.Claim(ctxT(t), d)
		ch <- claimOutcome{tx, c, err}
	}()
	return ch
}

func expectBlocked(t *testing.T, ch <-chan claimOutcome) {
	t.Helper()
	select {
	case o := <-ch:
		t.Fatalf("claim did not wait for the open claim of its key: %+v", o)
	case <-time.After(blockWindow):
	}
}

func expectResult(t *testing.T, ch <-chan claimOutcome) claimOutcome {
	t.Helper()
	select {
	case o := <-ch:
		if o.err != nil {
			t.Fatalf("claim: %v", o.err)
		}
		return o
	case <-time.After(5 * time.Second):
		t.Fatal("claim still blocked after the open claim ended")
	}
	return claimOutcome{}
}

func testConcurrentClaimWaitsThenSeesDuplicate(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, delivery("m1"), contract.Run)
	ch := claimInBackground(t, s, delivery("m1"))
	expectBlocked(t, ch)
	commit(t, tx)
	if o := expectResult(t, ch); o.c.Decision != contract.Duplicate || o.tx != nil {
		t.Fatalf("waiting copy: %+v, want a duplicate", o.c)
	}
}

func testConcurrentClaimProceedsAfterFail(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, delivery("m1"), contract.Run)
	ch := claimInBackground(t, s, delivery("m1"))
	expectBlocked(t, ch)
	fail(t, tx, contract.Failure{})
	o := expectResult(t, ch)
	if o.c.Decision != contract.Run {
		t.Fatalf("waiting copy: %+v, want Run", o.c)
	}
	commit(t, o.tx)
}

func testDistinctKeysDoNotBlock(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, delivery("m1"), contract.Run)
	defer fail(t, tx, contract.Failure{})
	done := make(chan error, 1)
	go func() {
		tx2, c, err := s.Claim(ctxT(t), delivery("m2"))
		if err == nil && c.Decision == contract.Run {
			err = tx2.Commit(context.Background())
		} else if err == nil {
			err = fmt.Errorf("decision %d", c.Decision)
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(blockWindow):
		t.Fatal("a claim of another key waited")
	}
}

func testCancelledClaimLeavesNothingOpen(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, delivery("m1"), contract.Run)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, _, err := s.Claim(ctx, delivery("m1")); err == nil {
		t.Fatal("a claim whose context ended while it waited succeeded")
	}
	commit(t, tx)
	claim(t, s, delivery("m1"), contract.Duplicate)
	// The cancelled claim left no transaction open: another key is claimed at once.
	tx, _ = claim(t, s, delivery("m2"), contract.Run)
	commit(t, tx)
}

func testOtherPayloadIsACollision(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, delivery("m1"), contract.Run)
	commit(t, tx)
	d := delivery("m1")
	h := sha256.Sum256([]byte("another payload"))
	d.PayloadHash = h[:]
	claim(t, s, d, contract.Collision)
	claim(t, s, delivery("m1"), contract.Duplicate)
}

func testUnsupportedIsolationRefused(t *testing.T, s contract.Store) {
	d := delivery("m1")
	d.Isolation = sql.LevelSnapshot
	if _, _, err := s.Claim(ctxT(t), d); err == nil {
		t.Fatal("an unsupported isolation level was accepted")
	}
	tx, _ := claim(t, s, delivery("m1"), contract.Run) // nothing was left behind
	commit(t, tx)
}

func testOrdinaryErrorsAreOther(t *testing.T, s contract.Store) {
	for _, err := range []error{errors.New("boom"), context.Canceled, fmt.Errorf("wrapped: %w", errors.New("x"))} {
		if c := s.Classify(err); c != contract.Other {
			t.Errorf("Classify(%v) = %d, want Other", err, c)
		}
	}
}

func testCountFirstSurvivesTheRollback(t *testing.T, s contract.Store) {
	tx, c := claim(t, s, counted("m1", true), contract.Run)
	if c.Attempts != 0 {
		t.Fatalf("earlier attempts %d, want 0", c.Attempts)
	}
	if n := fail(t, tx, contract.Failure{Counts: true, Error: "boom"}); n != 1 {
		t.Fatalf("attempts after the failure %d, want 1 (counted once)", n)
	}
	hasRecord(t, s, "m1", 1)
	tx, c = claim(t, s, counted("m1", true), contract.Run)
	if c.Attempts != 1 || c.LastError != "boom" {
		t.Fatalf("claim after one failure: %+v, want 1 attempt and its error", c)
	}
	if n := fail(t, tx, contract.Failure{Counts: true, Error: "bang"}); n != 2 {
		t.Fatalf("attempts after the second failure %d, want 2", n)
	}
}

func testFirstDeliveryCountsOnlyItsFailure(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, counted("m1", false), contract.Run)
	if n := fail(t, tx, contract.Failure{Counts: true, Error: "boom"}); n != 1 {
		t.Fatalf("attempts %d, want 1", n)
	}
	tx, c := claim(t, s, counted("m1", false), contract.Run)
	if c.Attempts != 1 {
		t.Fatalf("earlier attempts %d, want 1", c.Attempts)
	}
	commit(t, tx)
}

func testNotTheMessagesFaultTakesTheCountBack(t *testing.T, s contract.Store) {
	for range 3 {
		tx, _ := claim(t, s, counted("m1", true), contract.Run)
		if n := fail(t, tx, contract.Failure{}); n != 0 {
			t.Fatalf("attempts %d after a failure that is not the message's, want 0", n)
		}
	}
	noRecord(t, s, "m1")
	tx, c := claim(t, s, counted("m1", true), contract.Run)
	if c.Attempts != 0 {
		t.Fatalf("earlier attempts %d, want 0", c.Attempts)
	}
	commit(t, tx)
}

func testExhaustedAfterMaxAttempts(t *testing.T, s contract.Store) {
	for i := range 3 {
		tx, c := claim(t, s, counted("m1", true), contract.Run)
		if c.Attempts != i {
			t.Fatalf("try %d: earlier attempts %d", i, c.Attempts)
		}
		fail(t, tx, contract.Failure{Counts: true, Error: fmt.Sprintf("boom %d", i)})
	}
	for range 2 {
		_, c := claim(t, s, counted("m1", true), contract.Exhausted)
		if c.Attempts != 3 || c.LastError != "boom 2" {
			t.Fatalf("exhausted claim: %+v, want 3 attempts and the last error", c)
		}
		hasRecord(t, s, "m1", 3) // an exhausted claim counts nothing
	}
}

func testCommitClearsTheRecord(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, counted("m1", true), contract.Run)
	fail(t, tx, contract.Failure{Counts: true, Error: "boom"})
	tx, _ = claim(t, s, counted("m1", true), contract.Run)
	commit(t, tx)
	claim(t, s, counted("m1", true), contract.Duplicate)
	noRecord(t, s, "m1")
}

// noRecord fails t when id has an attempt record; hasRecord when it has none, or another count.
func noRecord(t *testing.T, s contract.Store, id string) {
	t.Helper()
	if n, ok := record(t, s, delivery(id).Key); ok {
		t.Fatalf("%s still has an attempt record (%d attempts)", id, n)
	}
}

func hasRecord(t *testing.T, s contract.Store, id string, attempts int) {
	t.Helper()
	if n, ok := record(t, s, delivery(id).Key); !ok || n != attempts {
		t.Fatalf("%s: attempt record %d (present %v), want %d", id, n, ok, attempts)
	}
}

func testWaitingCopyIsNotCounted(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, counted("m1", true), contract.Run)
	ch := claimInBackground(t, s, counted("m1", true))
	expectBlocked(t, ch)
	if n := fail(t, tx, contract.Failure{Counts: true, Error: "boom"}); n != 1 {
		t.Fatalf("attempts %d with a copy waiting, want 1", n)
	}
	o := expectResult(t, ch)
	if o.c.Decision != contract.Run || o.c.Attempts != 1 {
		t.Fatalf("waiting copy: %+v, want Run after 1 earlier attempt", o.c)
	}
	if n := fail(t, o.tx, contract.Failure{Counts: true, Error: "boom"}); n != 2 {
		t.Fatalf("attempts %d, want 2", n)
	}
	hasRecord(t, s, "m1", 2)
}

func testUnsettledAttemptsRunAlone(t *testing.T, s contract.Store) {
	// A count with no error recorded is what a crash inside the handler leaves.
	tx, _ := claim(t, s, counted("m1", true), contract.Run)
	fail(t, tx, contract.Failure{Counts: true})
	d := counted("m1", true)
	d.Isolate = true
	_, c := claim(t, s, d, contract.RunAlone)
	if c.Attempts != 1 {
		t.Fatalf("RunAlone: %+v, want 1 earlier attempt", c)
	}
	hasRecord(t, s, "m1", 1)                               // taken back
	tx, c = claim(t, s, counted("m1", true), contract.Run) // RunAlone counted nothing
	if c.Attempts != 1 {
		t.Fatalf("claim alone: %+v, want 1 earlier attempt", c)
	}
	fail(t, tx, contract.Failure{Counts: true, Error: "boom"})
	tx, _ = claim(t, s, d, contract.Run) // an error is recorded: no suspect
	commit(t, tx)
}

func testDeadLetteredUntilReplay(t *testing.T, s contract.Store) {
	k := delivery("m1").Key
	if ok, err := s.Replay(ctxT(t), k); err != nil || ok {
		t.Fatalf("replay of a key never dead-lettered: %v %v", ok, err)
	}
	if err := s.MarkDeadLettered(ctxT(t), k, "poison"); err != nil {
		t.Fatal(err)
	}
	for _, first := range []bool{true, false} {
		claim(t, s, counted("m1", first), contract.DeadLettered)
	}
	if ok, err := s.Replay(ctxT(t), k); err != nil || !ok {
		t.Fatalf("replay: %v %v", ok, err)
	}
	tx, c := claim(t, s, counted("m1", true), contract.Run)
	if c.Attempts != 0 {
		t.Fatalf("after replay: %+v", c)
	}
	commit(t, tx)
}

// batch claims ids in one batch, with counting when count, and checks the decisions.
func batch(t *testing.T, s contract.Store, count bool, want []contract.Decision, ids ...string) contract.BatchTx {
	t.Helper()
	ds := make([]contract.Delivery, len(ids))
	for k, id := range ids {
		ds[k] = delivery(id)
		if count {
			ds[k] = counted(id, true)
		}
	}
	tx, claims, err := s.ClaimBatch(ctxT(t), ds)
	if err != nil {
		t.Fatalf("batch claim: %v", err)
	}
	var got []string
	for _, c := range claims {
		got = append(got, fmt.Sprint(c.Decision))
	}
	var exp []string
	for _, d := range want {
		exp = append(exp, fmt.Sprint(d))
	}
	if strings.Join(got, ",") != strings.Join(exp, ",") {
		t.Fatalf("batch decisions %v, want %v", got, exp)
	}
	return tx
}

var run, dup = contract.Run, contract.Duplicate

func testBatchClaimsEachKeyOnce(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, delivery("b"), contract.Run)
	commit(t, tx)
	bt := batch(t, s, false, []contract.Decision{run, dup, run}, "a", "b", "c")
	if err := bt.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a", "b", "c"} {
		claim(t, s, delivery(id), contract.Duplicate)
	}
}

func testBatchDropRollsBackOnlyThatMember(t *testing.T, s contract.Store) {
	bt := batch(t, s, true, []contract.Decision{run, run, run}, "a", "b", "c")
	for k := range 3 {
		if err := bt.Savepoint(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		if k == 1 {
			if n, err := bt.Drop(ctxT(t), 1, contract.Failure{Counts: true, Error: "boom"}); err != nil || n != 1 {
				t.Fatalf("drop: %d %v", n, err)
			}
		}
	}
	if err := bt.Healthy(); err != nil {
		t.Fatalf("after a drop: %v", err)
	}
	if err := bt.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	claim(t, s, counted("a", true), contract.Duplicate)
	claim(t, s, counted("c", true), contract.Duplicate)
	tx, c := claim(t, s, counted("b", true), contract.Run)
	if c.Attempts != 1 || c.LastError != "boom" {
		t.Fatalf("dropped member: %+v", c)
	}
	commit(t, tx)
}

func testBatchRollbackLeavesNoMark(t *testing.T, s contract.Store) {
	bt := batch(t, s, true, []contract.Decision{run, run}, "a", "b")
	if err := bt.Rollback(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a", "b"} {
		noRecord(t, s, id)
		tx, c := claim(t, s, counted(id, true), contract.Run)
		if c.Attempts != 0 {
			t.Fatalf("%s after a rolled-back batch: %+v (the batch's counts are taken back)", id, c)
		}
		commit(t, tx)
	}
}

func testBatchHeldKeyRunsAlone(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, delivery("b"), contract.Run)
	bt := batch(t, s, false, []contract.Decision{run, contract.RunAlone}, "a", "b")
	if err := bt.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	fail(t, tx, contract.Failure{})
	claim(t, s, delivery("a"), contract.Duplicate)
	tx, _ = claim(t, s, delivery("b"), contract.Run)
	commit(t, tx)
}

func testBatchCountsAndClears(t *testing.T, s contract.Store) {
	tx, _ := claim(t, s, counted("a", true), contract.Run)
	fail(t, tx, contract.Failure{Counts: true, Error: "boom"})
	bt := batch(t, s, true, []contract.Decision{run, run}, "a", "b")
	if err := bt.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	claim(t, s, counted("a", true), contract.Duplicate)
	claim(t, s, counted("b", true), contract.Duplicate)
	noRecord(t, s, "a")
	noRecord(t, s, "b")
}

func testBatchDeadLetteredIsNotClaimed(t *testing.T, s contract.Store) {
	if err := s.MarkDeadLettered(ctxT(t), delivery("b").Key, "poison"); err != nil {
		t.Fatal(err)
	}
	bt := batch(t, s, true, []contract.Decision{run, contract.DeadLettered}, "a", "b")
	if err := bt.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	claim(t, s, counted("b", true), contract.DeadLettered)
	claim(t, s, counted("a", true), contract.Duplicate)
}
