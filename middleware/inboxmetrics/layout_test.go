package inboxmetrics_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-inbox/watermill-inbox/inboxtest"
	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxmetrics"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestTableCollectorOnTheCompactLayout: the oldest row's age is read from the compact
// layout's received_minute (to the minute): a row received 2 hours ago reads as 2 hours old.
func TestTableCollectorOnTheCompactLayout(t *testing.T) {
	ctx := context.Background()
	s := inboxtest.NewSchema(t, "t", 2)
	store, err := pgstore.New(s.Pool, pgstore.Config{Schema: s.Name, Layout: pgstore.LayoutCompact})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		tx, res, err := store.Claim(ctx, contract.Delivery{Key: contract.Key{MessageID: uuid.NewString(), ConsumerName: "billing"}})
		if err != nil || res.Decision != contract.Run {
			t.Fatalf("claim: %+v %v", res, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	s.Exec(t, "UPDATE "+store.Table()+" SET received_minute = received_minute - 120 WHERE ctid = (SELECT min(ctid) FROM "+store.Table()+")")
	c, err := inboxmetrics.NewTableCollector(store, inboxmetrics.TableConfig{})
	if err != nil {
		t.Fatal(err)
	}
	st, err := c.Read(ctx)
	if err != nil {
		t.Fatalf("Read on a compact table: %v", err)
	}
	if st.OldestAge < 2*time.Hour || st.OldestAge > 2*time.Hour+2*time.Minute {
		t.Fatalf("oldest row age %s, want 2 hours (to the minute)", st.OldestAge)
	}
}
