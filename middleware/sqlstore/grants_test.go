package sqlstore_test

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"

	"github.com/go-sql-driver/mysql"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/sqlstore"
)

// TestLeastPrivilegedUser creates a user with only GrantSQL's grants and runs, as that user,
// every step of a delivery: Migrate (nothing pending), a claim committed, a duplicate, a
// counted failure (counted first), a batch, a dead letter and its replay. The user cannot
// create a table.
func TestLeastPrivilegedUser(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		e := newEnv(t, d, 4)
		owner := e.store(t, sqlstore.Config{})
		user := randomName("wi_")
		var dsn string
		switch d {
		case sqlstore.MySQL:
			e.exec(t, "CREATE USER '"+user+"'@'%'")
			t.Cleanup(func() { _, _ = e.db.Exec("DROP USER IF EXISTS '" + user + "'@'%'") })
			cfg, _ := mysql.ParseDSN(e.dsn)
			cfg.User, cfg.Passwd = user, ""
			dsn = cfg.FormatDSN()
		case sqlstore.PostgreSQL:
			e.exec(t, "CREATE ROLE "+user+" LOGIN")
			t.Cleanup(func() {
				_, _ = e.db.Exec("DROP OWNED BY " + user)
				_, _ = e.db.Exec("DROP ROLE IF EXISTS " + user)
			})
			u, err := url.Parse(e.dsn)
			if err != nil {
				t.Fatal(err)
			}
			u.User = url.User(user)
			dsn = u.String()
		}
		script, err := sqlstore.GrantSQL(owner.Config(), user)
		if err != nil {
			t.Fatal(err)
		}
		for _, stmt := range strings.Split(strings.TrimSpace(script), "\n") {
			if !strings.HasPrefix(stmt, "--") {
				e.exec(t, strings.TrimSuffix(stmt, ";"))
			}
		}
		app := (&env{dialect: d, schema: e.schema}).open(t, dsn, 4)
		s, err := sqlstore.New(app, owner.Config())
		if err != nil {
			t.Fatal(err)
		}
		if applied, err := s.Migrate(ctxT(t)); err != nil || len(applied) != 0 {
			t.Fatalf("Migrate as the user: %v %v, want nothing to do", applied, err)
		}
		tx := mustClaim(t, s, plain("m1"), contract.Run)
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
		mustClaim(t, s, plain("m1"), contract.Duplicate)
		dl := plain("m2")
		dl.MaxAttempts, dl.CountFirst = 3, true
		tx = mustClaim(t, s, dl, contract.Run)
		if n, err := tx.Fail(context.Background(), contract.Failure{Counts: true, Error: "boom"}); err != nil || n != 1 {
			t.Fatalf("fail: %d %v", n, err)
		}
		bt, claims, err := s.ClaimBatch(ctxT(t), []contract.Delivery{plain("b1"), plain("b2")})
		if err != nil || claims[0].Decision != contract.Run || claims[1].Decision != contract.Run {
			t.Fatalf("batch: %+v %v", claims, err)
		}
		if err := bt.Savepoint(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		if _, err := bt.Drop(ctxT(t), 1, contract.Failure{}); err != nil {
			t.Fatal(err)
		}
		if err := bt.Commit(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		if err := s.MarkDeadLettered(ctxT(t), dl.Key, "poison"); err != nil {
			t.Fatal(err)
		}
		mustClaim(t, s, dl, contract.DeadLettered)
		if ok, err := s.Replay(ctxT(t), dl.Key); err != nil || !ok {
			t.Fatalf("replay: %v %v", ok, err)
		}
		if n := processedRows(t, owner); n != 2 {
			t.Fatalf("%d processed rows, want 2 (m1, b1)", n)
		}
		_, err = app.Exec("CREATE TABLE not_allowed (id int)")
		if err == nil || s.Classify(err) != contract.ConfigFault {
			t.Fatalf("CREATE TABLE as the user: %v, want a refused privilege (ConfigFault)", err)
		}
	})
}

func TestGrantSQLRefusesBadNames(t *testing.T) {
	for _, c := range []struct {
		d    sqlstore.Dialect
		user string
	}{
		{sqlstore.MySQL, "app'@'%"}, {sqlstore.MySQL, ""}, {sqlstore.MySQL, "a b"},
		{sqlstore.PostgreSQL, "public"}, {sqlstore.PostgreSQL, "pg_write_all_data"}, {sqlstore.PostgreSQL, "App"},
	} {
		if _, err := sqlstore.GrantSQL(sqlstore.Config{Dialect: c.d}, c.user); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("GrantSQL(%s, %q): %v, want ErrInvalidConfig", c.d, c.user, err)
		}
	}
}
