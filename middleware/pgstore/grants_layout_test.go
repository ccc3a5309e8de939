package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestGrantSQLRunsEveryLayout: on every layout, a role granted exactly what GrantSQL prints
// (and nothing that lets it create) runs the store's whole path: Migrate and CheckSchema with
// nothing pending, the claim of a consumer name it registers itself (the compact layout's
// consumers table), a commit, a duplicate, a counted claim that fails and records its attempt,
// the claim that then succeeds, and a purge. The rows prove each step.
func TestGrantSQLRunsEveryLayout(t *testing.T) {
	for _, l := range everyLayout {
		t.Run(l.name, func(t *testing.T) {
			owner, sch := layoutStore(t, 2, l.cfg)
			ctx := context.Background()
			_, roleURL := testenv.GrantedRole(t, sch, func(role string) (string, error) { return pgstore.GrantSQL(owner.Config(), role) })
			cfg := owner.Config()
			cfg.Retention = inbox.Retention{Window: 48 * time.Hour, MaxRedelivery: time.Hour, Margin: time.Hour}
			s, err := pgstore.New(testenv.NewPool(t, roleURL, 2), cfg)
			if err != nil {
				t.Fatal(err)
			}
			if applied, err := s.Migrate(ctx); err != nil || len(applied) != 0 {
				t.Fatalf("Migrate as the application role: %v, %v", applied, err)
			}
			if err := s.CheckSchema(ctx); err != nil {
				t.Fatalf("CheckSchema as the application role: %v", err)
			}
			keys := newLayoutKeys(l.cfg)
			p := keys.claim("m-granted")
			p.Key.ConsumerName = "billing-" + l.name // registered by the role itself
			tx, _ := mustClaim(t, s, p, contract.Run)
			if n, err := tx.Fail(ctx, contract.Failure{Counts: true, Error: "boom"}); err != nil || n != 1 {
				t.Fatalf("Fail as the application role: %d, %v", n, err)
			}
			if n, _ := attemptsRow(t, sch.Pool, s, p.Key); n != 1 {
				t.Fatalf("%d attempts recorded after the failure, want 1", n)
			}
			tx, c := mustClaim(t, s, p, contract.Run)
			if c.Attempts != 1 || c.LastError != "boom" {
				t.Fatalf("second claim: %+v, want 1 earlier attempt and its error", c)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatalf("commit as the application role: %v", err)
			}
			mustClaim(t, s, p, contract.Duplicate)
			if err := s.MarkDeadLettered(ctx, keys.claim("m-dead").Key, "poison"); err != nil {
				t.Fatalf("MarkDeadLettered as the application role: %v", err)
			}
			if ok, err := s.Replay(ctx, keys.claim("m-dead").Key); err != nil || !ok {
				t.Fatalf("Replay as the application role: %v %v", ok, err)
			}
			if _, err := s.PurgeExpired(ctx, pgstore.PurgeExpiredParams{}); err != nil {
				t.Fatalf("PurgeExpired as the application role: %v", err)
			}
			rows, records := rowsAndRecords(t, sch.Pool, s)
			if rows != 1 || records != 0 {
				t.Fatalf("%d inbox rows and %d attempt records, want 1 and 0", rows, records)
			}
		})
	}
}
