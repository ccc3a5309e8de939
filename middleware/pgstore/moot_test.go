package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestMootDeadLettersGoWithTheirRows: a dead-lettered record whose key is processed (a copy
// the producer sent again was applied by its first delivery, which reads no record) is moot.
// On every layout: Replay refuses it (false) and deletes it; Purge, and for partitioned tables
// DropPartitions, delete it with its key's inbox row, so no later Replay can republish a
// message whose processing was forgotten. A dead-lettered record of an unprocessed key stays.
func TestMootDeadLettersGoWithTheirRows(t *testing.T) {
	partitioned := &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}
	for _, tc := range []struct {
		name string
		cfg  pgstore.Config
	}{
		{"Text", pgstore.Config{}},
		{"Compact", pgstore.Config{Layout: pgstore.LayoutCompact}},
		{"Partitioned", pgstore.Config{Partitioning: partitioned}},
		{"CompactPartitioned", pgstore.Config{Layout: pgstore.LayoutCompact, Partitioning: partitioned}},
	} {
		for _, purge := range []string{"Purge", "DropPartitions"} {
			if purge == "DropPartitions" && tc.cfg.Partitioning == nil {
				continue
			}
			t.Run(tc.name+"/"+purge, func(t *testing.T) {
				s, sch := layoutStore(t, 4, tc.cfg)
				ctx := context.Background()
				key := func() inbox.Key {
					id, err := uuid.NewV7()
					if err != nil {
						t.Fatal(err)
					}
					return inbox.Key{MessageID: id.String(), ConsumerName: "billing"}
				}
				processed := func(k inbox.Key) {
					t.Helper()
					tx, res, err := s.Claim(ctx, inbox.ClaimParams{Key: k})
					if err != nil || !res.Claimed {
						t.Fatalf("claim: %+v, %v", res, err)
					}
					if err := tx.Commit(ctx); err != nil {
						t.Fatal(err)
					}
				}
				deadLettered := func(k inbox.Key) {
					t.Helper()
					if err := s.MarkDeadLettered(ctx, inbox.AttemptParams{Key: k, Error: "failed 1 of 1 attempts"}); err != nil {
						t.Fatal(err)
					}
				}
				records := func() int {
					t.Helper()
					var n int
					if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+s.AttemptsTable()).Scan(&n); err != nil {
						t.Fatal(err)
					}
					return n
				}
				moot, replayed, pending := key(), key(), key()
				for _, k := range []inbox.Key{moot, replayed} {
					deadLettered(k)
					processed(k)
				}
				deadLettered(pending)
				if ok, err := s.Replay(ctx, inbox.AttemptParams{Key: replayed}); err != nil || ok {
					t.Fatalf("Replay of a dead letter processed since = %v, %v; want false", ok, err)
				}
				if n := records(); n != 2 {
					t.Fatalf("%d attempt records after Replay, want 2 (Replay deletes the moot one)", n)
				}
				if purge == "Purge" {
					if _, err := s.Purge(ctx, inbox.PurgeParams{Before: time.Now().Add(time.Hour)}); err != nil {
						t.Fatal(err)
					}
				} else if _, err := s.DropPartitions(ctx, time.Now().AddDate(1, 0, 0)); err != nil {
					t.Fatal(err)
				}
				var rows int
				if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+s.Table()).Scan(&rows); err != nil {
					t.Fatal(err)
				}
				if n := records(); rows != 0 || n != 1 {
					t.Fatalf("after %s: %d inbox rows, %d attempt records; want 0 and 1 (the unprocessed key's)", purge, rows, n)
				}
				if ok, err := s.Replay(ctx, inbox.AttemptParams{Key: pending}); err != nil || !ok {
					t.Fatalf("Replay of a dead letter never processed = %v, %v; want true", ok, err)
				}
			})
		}
	}
}

// TestCompactReplayOfANonUUIDDeadLetter: a dead letter whose key the compact table cannot hold
// (kept in the attempts table from the text layout, which a conversion leaves as it is) is
// replayed, not refused with a uuid cast error.
func TestCompactReplayOfANonUUIDDeadLetter(t *testing.T) {
	s, _ := layoutStore(t, 4, pgstore.Config{Layout: pgstore.LayoutCompact})
	ctx := context.Background()
	k := inbox.Key{MessageID: "order-17", ConsumerName: "billing"}
	if err := s.MarkDeadLettered(ctx, inbox.AttemptParams{Key: k, Error: "failed 3 of 3 attempts"}); err != nil {
		t.Fatal(err)
	}
	if ok, err := s.Replay(ctx, inbox.AttemptParams{Key: k}); err != nil || !ok {
		t.Fatalf("Replay of a dead letter never processed = %v, %v; want true", ok, err)
	}
}
