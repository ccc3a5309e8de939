package deferred_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestGrantSQLRunsTheWholePath: a role granted exactly what deferred.GrantSQL prints (plus
// SELECT, UPDATE on the handler's accounts table), which cannot create tables, runs the
// store-then-process inbox end to end: Migrate and CheckSchema with nothing pending,
// receipts, a duplicate receipt, the workers, stats, and a purge of done rows. Balances and
// rows prove each step.
func TestGrantSQLRunsTheWholePath(t *testing.T) {
	_, sch := newInbox(t, deferred.Config{}, 2) // migrated by the schema's owner
	ctx := context.Background()
	_, roleURL := testenv.GrantedRole(t, sch, func(role string) (string, error) {
		grants, err := deferred.GrantSQL(deferred.Config{Schema: sch.Name}, role)
		return grants + "GRANT SELECT, UPDATE ON accounts TO " + pgx.Identifier{role}.Sanitize() + ";\n", err
	})
	app := testenv.NewPool(t, roleURL, 6)
	ib, err := deferred.New(deferred.Config{Pool: app, Schema: sch.Name, ConsumerName: "billing", PollInterval: 100 * time.Millisecond,
		Retention: inbox.Retention{Window: 48 * time.Hour, MaxRedelivery: time.Hour, Margin: time.Hour}}, testLogger)
	if err != nil {
		t.Fatal(err)
	}
	if applied, err := ib.Migrate(ctx); err != nil || len(applied) != 0 {
		t.Fatalf("Migrate as the application role: %v, %v", applied, err)
	}
	if err := ib.CheckSchema(ctx); err != nil {
		t.Fatalf("CheckSchema as the application role: %v", err)
	}
	for k := range 10 {
		m := payment("grant-"+string(rune('a'+k)), 1+k%2, 5, 0)
		if err := ib.Receive(m); err != nil {
			t.Fatalf("receipt as the application role: %v", err)
		}
		if k == 0 {
			if err := ib.Receive(m.Copy()); err != nil {
				t.Fatalf("duplicate receipt as the application role: %v", err)
			}
		}
	}
	runWorkers(t, ib.NewConsumerWorkers(credit))
	waitFor(t, 10*time.Second, "10 done rows", func() bool {
		return count(t, sch.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 10
	})
	if got := count(t, sch.Pool, "SELECT sum(balance) FROM accounts"); got != 50 {
		t.Fatalf("balance %d, want 50 (each payment once)", got)
	}
	if st, err := ib.Stats(ctx); err != nil || st.Counters.Done != 10 {
		t.Fatalf("stats as the application role: %+v, %v", st, err)
	}
	if _, err := ib.PurgeExpired(ctx, pgstore.PurgeExpiredParams{}); err != nil {
		t.Fatalf("purge as the application role: %v", err)
	}
	if n := count(t, sch.Pool, "SELECT count(*) FROM inbox_deferred"); n != 10 {
		t.Fatalf("%d rows after the purge, want 10 (all inside the window)", n)
	}
}
