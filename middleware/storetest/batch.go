package storetest

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// runBatch runs the cases of the optional inbox.BatchStore capability (group commit).
func runBatch(t *testing.T, newStore func(t *testing.T) inbox.Store) {
	cases := []struct {
		name    string
		counted bool
		fn      func(t *testing.T, s inbox.BatchStore)
	}{
		{"ClaimsEachKeyOnce", false, testBatchClaimsEachKeyOnce},
		{"DropRollsBackOnlyThatMember", false, testBatchDropRollsBackOnlyThatMember},
		{"RollbackLeavesNoMark", false, testBatchRollbackLeavesNoMark},
		{"WaitsOnAHeldKey", false, testBatchWaitsOnAHeldKey},
		{"CountsAndClears", true, testBatchCountsAndClears},
		{"DeadLetteredIsNotClaimed", true, testBatchDeadLetteredIsNotClaimed},
		{"CountedCopyReadsTheDroppedFailure", true, testBatchCountedCopyReadsTheDroppedFailure},
	}
	for _, tc := range cases {
		t.Run("Batch/"+tc.name, func(t *testing.T) {
			s := newStore(t)
			bs, ok := s.(inbox.BatchStore)
			if !ok {
				t.Skip("the store does not implement inbox.BatchStore")
			}
			if err := bs.BatchSupported(); err != nil {
				t.Skipf("the store, as configured, claims no batches: %v", err)
			}
			if _, ok := s.(inbox.AttemptStore); tc.counted && !ok {
				t.Skip("the store does not implement inbox.AttemptStore")
			}
			tc.fn(t, bs)
		})
	}
}

// claimBatch claims ids as one batch (CountFirst for every member when first is set).
func claimBatch(t *testing.T, s inbox.BatchStore, counted, first bool, ids ...string) (inbox.BatchTx, []inbox.CountedClaimResult) {
	t.Helper()
	p := inbox.BatchClaimParams{Counted: counted}
	for _, id := range ids {
		p.Claims = append(p.Claims, inbox.CountedClaimParams{ClaimParams: params(id), CountFirst: first})
	}
	tx, res, err := s.ClaimBatch(ctxT(t), p)
	if err != nil {
		t.Fatalf("ClaimBatch(%v): %v", ids, err)
	}
	if len(res) != len(ids) {
		t.Fatalf("ClaimBatch(%v) returned %d results", ids, len(res))
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx, res
}

func testBatchClaimsEachKeyOnce(t *testing.T, s inbox.BatchStore) {
	done := params("b-done")
	done.PayloadHash = []byte("0123456789abcdef0123456789abcdef")
	committedClaim(t, s, done)
	tx, res := claimBatch(t, s, false, false, "b-a", "b-done", "b-c")
	if !res[0].Claimed || res[1].Claimed || !res[2].Claimed {
		t.Fatalf("claimed %v %v %v, want true false true", res[0].Claimed, res[1].Claimed, res[2].Claimed)
	}
	// The whole hash, or a prefix of at least 2 bytes (ClaimResult.StoredPayloadHash).
	if h := res[1].StoredPayloadHash; len(h) < 2 || !strings.HasPrefix(string(done.PayloadHash), string(h)) {
		t.Fatalf("the duplicate's stored hash %x, want %x or a prefix of it of at least 2 bytes", h, done.PayloadHash)
	}
	if err := tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"b-a", "b-done", "b-c"} {
		if committedClaim(t, s, params(id)) {
			t.Fatalf("%s claimed again after the batch committed", id)
		}
	}
}

func testBatchDropRollsBackOnlyThatMember(t *testing.T, s inbox.BatchStore) {
	tx, _ := claimBatch(t, s, false, false, "d-1", "d-2", "d-3")
	for m := range 3 {
		if err := tx.Savepoint(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		if m == 1 {
			if _, err := tx.Drop(ctxT(t), 1, inbox.FailParams{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if committedClaim(t, s, params("d-1")) || committedClaim(t, s, params("d-3")) {
		t.Fatal("a member still in the batch was not processed by its commit")
	}
	if !committedClaim(t, s, params("d-2")) {
		t.Fatal("the dropped member was processed by the batch's commit")
	}
}

func testBatchRollbackLeavesNoMark(t *testing.T, s inbox.BatchStore) {
	tx, _ := claimBatch(t, s, false, false, "r-1", "r-2")
	if err := tx.Rollback(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"r-1", "r-2"} {
		if !committedClaim(t, s, params(id)) {
			t.Fatalf("%s left a processed mark after the batch rolled back", id)
		}
	}
}

func testBatchWaitsOnAHeldKey(t *testing.T, s inbox.BatchStore) {
	first, _ := mustClaim(t, s, params("w-x"))
	ch := make(chan []inbox.CountedClaimResult, 1)
	go func() {
		p := inbox.BatchClaimParams{Claims: []inbox.CountedClaimParams{{ClaimParams: params("w-x")}, {ClaimParams: params("w-y")}}}
		tx, res, err := s.ClaimBatch(ctxT(t), p)
		if err != nil {
			t.Errorf("ClaimBatch: %v", err)
			ch <- nil
			return
		}
		_ = tx.Commit(context.Background())
		ch <- res
	}()
	select {
	case <-ch:
		t.Fatal("a batch claiming a key held by an open transaction returned at once; it must wait")
	case <-time.After(blockWindow):
	}
	if err := first.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	select {
	case res := <-ch:
		if res == nil || res[0].Claimed || !res[1].Claimed {
			t.Fatalf("batch after the holder committed: %+v, want w-x a duplicate and w-y claimed", res)
		}
	case <-time.After(10 * blockWindow):
		t.Fatal("the batch did not return after the holder committed")
	}
}

func testBatchCountsAndClears(t *testing.T, s inbox.BatchStore) {
	as := s.(inbox.AttemptStore)
	tx, res := claimBatch(t, s, true, true, "c-1", "c-2")
	if !res[0].Counted || res[0].Record.Attempts != 1 || !res[1].Counted {
		t.Fatalf("counted batch: %+v", res)
	}
	if err := tx.Rollback(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if n := attemptsOf(t, as, "c-1"); n != 0 {
		t.Fatalf("attempts after the batch rolled back = %d, want 0: Rollback takes the counts back", n)
	}
	tx, res = claimBatch(t, s, true, true, "c-1", "c-2")
	if res[1].Record.Attempts != 1 {
		t.Fatalf("%+v", res[1])
	}
	if n, err := tx.Drop(ctxT(t), 1, inbox.FailParams{Error: "boom"}); err != nil || n != 1 {
		t.Fatalf("Drop = %d, %v; want 1", n, err)
	}
	if err := tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if n := attemptsOf(t, as, "c-1"); n != 0 {
		t.Fatalf("a processed member keeps an attempt record of %d", n)
	}
	if n := attemptsOf(t, as, "c-2"); n != 1 {
		t.Fatalf("the dropped member's attempts = %d, want 1", n)
	}
	if !committedClaim(t, s, params("c-2")) {
		t.Fatal("the dropped member was processed")
	}
}

func testBatchDeadLetteredIsNotClaimed(t *testing.T, s inbox.BatchStore) {
	as := s.(inbox.AttemptStore)
	if err := as.MarkDeadLettered(ctxT(t), inbox.AttemptParams{Key: params("x-dead").Key, Error: "poison"}); err != nil {
		t.Fatal(err)
	}
	tx, res := claimBatch(t, s, true, true, "x-dead", "x-ok")
	if res[0].Claimed || !res[0].Record.DeadLettered || !res[1].Claimed {
		t.Fatalf("%+v; want x-dead not claimed and reported dead-lettered, x-ok claimed", res)
	}
	if err := tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if _, r := counted(t, as, params("x-dead"), false); !r.Record.DeadLettered {
		t.Fatalf("x-dead after the batch: %+v, want still dead-lettered", r)
	}
}

func testBatchCountedCopyReadsTheDroppedFailure(t *testing.T, s inbox.BatchStore) {
	as := s.(inbox.AttemptStore)
	tx, _ := claimBatch(t, s, true, false, "f-1", "f-2")
	copyCh := countedInBackground(t, as, params("f-2"), true)
	expectBlocked(t, copyCh)
	if err := tx.Savepoint(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Drop(ctxT(t), 1, inbox.FailParams{AttemptsDelta: 1, Error: "boom"}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	r := expectResult(t, copyCh)
	if r.err != nil || !r.res.Claimed || r.rec.Attempts != 2 || r.rec.LastError != "boom" {
		t.Fatalf("the copy waiting behind the batch: claimed=%v rec=%+v err=%v; want claimed, attempts 2 (the failure and itself)", r.res.Claimed, r.rec, r.err)
	}
}
