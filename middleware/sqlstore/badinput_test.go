package sqlstore_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/sqlstore"
)

// Bad input: each a clear, typed error, and nothing stored or lost.

func TestOpenRefusesABadDSN(t *testing.T) {
	for _, c := range []struct {
		d   sqlstore.Dialect
		dsn string
	}{
		{sqlstore.MySQL, "root@tcp(127.0.0.1:3306"},             // no closing parenthesis
		{sqlstore.MySQL, "root@tcp(127.0.0.1:3306)/test?x=%zz"}, // bad escape
		{sqlstore.MySQL, "root@tcp(127.0.0.1:3306)/test?clientFoundRows=true"},
		{sqlstore.MySQL, "root@tcp(127.0.0.1:3306)/test?multiStatements=true"},
		{sqlstore.PostgreSQL, "postgres://u:secret-password@127.0.0.1:5432/test?sslmode=nonsense"},
		{sqlstore.PostgreSQL, "postgres://u:secret-password@[::1/test"},
	} {
		_, err := sqlstore.Open(context.Background(), c.d, c.dsn)
		if !errors.Is(err, sqlstore.ErrBadDSN) || !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("Open(%s, %q): %v, want ErrBadDSN", c.d, c.dsn, err)
		}
		if err != nil && strings.Contains(err.Error(), "secret-password") {
			t.Errorf("Open(%s): the error shows the password: %v", c.d, err)
		}
	}
}

// TestServerDown: a database that does not answer (a closed port) is ErrUnreachable at Open,
// and a claim on it fails with no Tx and leaves nothing behind: the inbox nacks the delivery.
func TestServerDown(t *testing.T) {
	for _, c := range []struct {
		d   sqlstore.Dialect
		dsn string
	}{
		{sqlstore.MySQL, "root@tcp(127.0.0.1:1)/test?timeout=1s"},
		{sqlstore.PostgreSQL, "postgres://root@127.0.0.1:1/test?connect_timeout=1"},
	} {
		t.Run(c.d.String(), func(t *testing.T) {
			if _, err := sqlstore.Open(ctxT(t), c.d, c.dsn); !errors.Is(err, sqlstore.ErrUnreachable) {
				t.Fatalf("Open on a closed port: %v, want ErrUnreachable", err)
			}
			db := (&env{dialect: c.d}).open(t, c.dsn, 2)
			s, err := sqlstore.New(db, sqlstore.Config{Dialect: c.d})
			if err != nil {
				t.Fatal(err)
			}
			tx, _, err := s.Claim(ctxT(t), plain("m1"))
			if err == nil || tx != nil {
				t.Fatalf("claim with the server down: %v (Tx %v), want an error and no Tx", err, tx != nil)
			}
			if c := s.Classify(err); c == contract.Retryable {
				t.Fatalf("a connection failure classified Retryable (the transaction did not even start)")
			}
			if db.Stats().InUse != 0 {
				t.Fatalf("%d connections left in use", db.Stats().InUse)
			}
		})
	}
}

// TestMissingTable: a claim on a store whose tables were never migrated fails with the
// server's error (MySQL 1146, PostgreSQL 42P01), a ConfigFault, and no Tx.
func TestMissingTable(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		e := newEnv(t, d, 4)
		s, err := sqlstore.New(e.db, sqlstore.Config{Dialect: d, Schema: e.schema})
		if err != nil {
			t.Fatal(err)
		}
		tx, _, err := s.Claim(ctxT(t), plain("m1"))
		var pgErr *pgconn.PgError
		var myErr *mysql.MySQLError
		switch {
		case tx != nil:
			t.Fatal("a claim on a missing table returned a Tx")
		case d == sqlstore.PostgreSQL && !(errors.As(err, &pgErr) && pgErr.Code == "42P01"):
			t.Fatalf("claim: %v, want SQLSTATE 42P01", err)
		case d == sqlstore.MySQL && !(errors.As(err, &myErr) && myErr.Number == 1146):
			t.Fatalf("claim: %v, want error 1146", err)
		case s.Classify(err) != contract.ConfigFault:
			t.Fatalf("Classify(%v) = %d, want ConfigFault", err, s.Classify(err))
		}
		if e.db.Stats().InUse != 0 {
			t.Fatalf("%d connections left in use", e.db.Stats().InUse)
		}
		// Once migrated, the same delivery is claimed: nothing was lost.
		if _, err := s.Migrate(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		tx = mustClaim(t, s, plain("m1"), contract.Run)
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
}

// TestKeysTheColumnsCannotHold: a key longer than the column (513 bytes) or not valid UTF-8
// is refused before the server, with ErrKeyNotStorable (an inbox.ErrInvalidKey), storing
// nothing; a key of exactly 512 bytes, multi-byte characters included, is stored whole.
func TestKeysTheColumnsCannotHold(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		e := newEnv(t, d, 4)
		s := e.store(t, sqlstore.Config{})
		for name, id := range map[string]string{
			"513 bytes":        strings.Repeat("k", 513),
			"257 two-byte":     strings.Repeat("é", 257),
			"invalid UTF-8":    "key-\xff\xfe",
			"truncated UTF-8":  "key-\xc3",
			"NUL":              "key\x00x",
			"empty":            "",
			"consumer too big": "",
		} {
			dl := plain(id)
			if name == "consumer too big" {
				dl = plain("ok")
				dl.Key.ConsumerName = strings.Repeat("c", 129)
			}
			if err := s.Check(dl); !errors.Is(err, sqlstore.ErrKeyNotStorable) || !errors.Is(err, inbox.ErrInvalidKey) {
				t.Errorf("%s: Check: %v, want ErrKeyNotStorable", name, err)
			}
			tx, _, err := s.Claim(ctxT(t), dl)
			if !errors.Is(err, sqlstore.ErrKeyNotStorable) || tx != nil {
				t.Errorf("%s: Claim: %v, want ErrKeyNotStorable and no Tx", name, err)
			}
			if err != nil && len(id) > 8 && strings.Contains(err.Error(), id) {
				t.Errorf("%s: the error shows the key", name)
			}
		}
		if n := processedRows(t, s); n != 0 {
			t.Fatalf("%d rows stored from refused keys", n)
		}
		for _, id := range []string{strings.Repeat("k", 512), strings.Repeat("é", 256), strings.Repeat("€", 170) + "ab"} {
			tx := mustClaim(t, s, plain(id), contract.Run)
			if err := tx.Commit(context.Background()); err != nil {
				t.Fatal(err)
			}
			mustClaim(t, s, plain(id), contract.Duplicate)
		}
		q := "SELECT count(*) FROM " + s.Table() + " WHERE message_id = " + e.ph(1)
		if n := e.count(t, q, strings.Repeat("é", 256)); n != 1 {
			t.Fatalf("the 512-byte key is not stored whole (%d rows match)", n)
		}
	})
}

// TestKeysDifferingInCaseOrTrailingSpaceStayDistinct: the key columns compare byte for byte
// (VARBINARY on MySQL, text on PostgreSQL), so "Key", "key", "key " and "key\t" are four keys,
// each processed once.
func TestKeysDifferingInCaseOrTrailingSpaceStayDistinct(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		e := newEnv(t, d, 4)
		s := e.store(t, sqlstore.Config{})
		ids := []string{"Key", "key", "key ", "key\t", "KEY  "}
		for _, id := range ids {
			tx := mustClaim(t, s, plain(id), contract.Run)
			if err := tx.Commit(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		for _, id := range ids {
			mustClaim(t, s, plain(id), contract.Duplicate)
		}
		if n := processedRows(t, s); n != len(ids) {
			t.Fatalf("%d rows, want %d", n, len(ids))
		}
		c := plain("key")
		c.Key.ConsumerName = "C"
		tx := mustClaim(t, s, c, contract.Run) // consumer names too
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
}

// TestMySQLPadSpaceCollationWouldMergeKeys records why the MySQL key columns are VARBINARY:
// under utf8mb4_bin (PAD SPACE in MariaDB 10.11) 'key' and 'key ' are one primary key, and
// under utf8mb4_general_ci (the server's default here) 'Key' and 'key' are too.
func TestMySQLPadSpaceCollationWouldMergeKeys(t *testing.T) {
	e := newEnv(t, sqlstore.MySQL, 2)
	for _, c := range []struct{ collation, a, b string }{
		{"utf8mb4_bin", "key", "key "},
		{"utf8mb4_general_ci", "Key", "key"},
	} {
		e.exec(t, "CREATE TABLE pad_"+c.collation+" (k VARCHAR(16) CHARACTER SET utf8mb4 COLLATE "+c.collation+" PRIMARY KEY)")
		e.exec(t, "INSERT INTO pad_"+c.collation+" VALUES (?)", c.a)
		_, err := e.db.Exec("INSERT INTO pad_"+c.collation+" VALUES (?)", c.b)
		if mysqlNumber(err) != 1062 {
			t.Fatalf("%s: %q after %q: %v, want a duplicate (1062)", c.collation, c.b, c.a, err)
		}
	}
}

// TestDuplicateCarriesItsStoredTime: a duplicate (single or in a batch) reports when its
// claim was stored (contract.Claim.StoredAt, the inbox's DuplicateAge), by the database's
// clock.
func TestDuplicateCarriesItsStoredTime(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		e := newEnv(t, d, 4)
		s := e.store(t, sqlstore.Config{})
		before := time.Now()
		tx := mustClaim(t, s, plain("m1"), contract.Run)
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
		_, c, err := s.Claim(ctxT(t), plain("m1"))
		if err != nil || c.Decision != contract.Duplicate {
			t.Fatalf("claim: %+v %v", c, err)
		}
		if c.StoredAt.Before(before.Add(-2*time.Second)) || c.StoredAt.After(time.Now().Add(2*time.Second)) {
			t.Fatalf("StoredAt %s, want about %s", c.StoredAt, before)
		}
		bt, cs, err := s.ClaimBatch(ctxT(t), []contract.Delivery{plain("m1"), plain("m2")})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = bt.Rollback(context.Background()) }()
		if cs[0].Decision != contract.Duplicate || !cs[0].StoredAt.Equal(c.StoredAt) {
			t.Fatalf("batch duplicate: %+v, want StoredAt %s", cs[0], c.StoredAt)
		}
	})
}
