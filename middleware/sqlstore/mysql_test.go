package sqlstore_test

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/middleware/sqlstore"
)

// The MySQL/MariaDB semantics the store relies on, each shown on the real MariaDB.

// warnings returns the codes SHOW WARNINGS lists on conn.
func warnings(t *testing.T, conn *sql.Conn) []int {
	t.Helper()
	rows, err := conn.QueryContext(context.Background(), "SHOW WARNINGS")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rows.Close() }()
	var codes []int
	for rows.Next() {
		var level, msg string
		var code int
		if err := rows.Scan(&level, &code, &msg); err != nil {
			t.Fatal(err)
		}
		codes = append(codes, code)
	}
	return codes
}

func mysqlNumber(err error) uint16 {
	var me *mysql.MySQLError
	if errors.As(err, &me) {
		return me.Number
	}
	return 0
}

// TestMySQLInsertIgnoreVersusOnDuplicateKeyUpdate shows why the claim is INSERT ... ON
// DUPLICATE KEY UPDATE and not INSERT IGNORE: IGNORE reports a duplicate as warning 1062,
// but it also turns an over-long key into a warning and stores it truncated, so a second,
// distinct long key with the same first 512 bytes would be skipped as a duplicate. ON
// DUPLICATE KEY UPDATE reports the duplicate as 0 rows with no warning and refuses the
// over-long key with error 1406, storing nothing.
func TestMySQLInsertIgnoreVersusOnDuplicateKeyUpdate(t *testing.T) {
	e := newEnv(t, sqlstore.MySQL, 4)
	s := e.store(t, sqlstore.Config{})
	conn, err := e.db.Conn(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	ctx := context.Background()
	ins := func(verb, tail, id string) (int64, error) {
		r, err := conn.ExecContext(ctx, verb+" INTO "+s.Table()+" (message_id, consumer_name) VALUES (?, 'c')"+tail, id)
		if err != nil {
			return 0, err
		}
		return r.RowsAffected()
	}
	const odku = " ON DUPLICATE KEY UPDATE message_id = message_id"
	if n, err := ins("INSERT", odku, "k1"); err != nil || n != 1 {
		t.Fatalf("first insert: %d %v", n, err)
	}
	if n, err := ins("INSERT IGNORE", "", "k1"); err != nil || n != 0 {
		t.Fatalf("INSERT IGNORE of a duplicate: %d %v", n, err)
	}
	if w := warnings(t, conn); len(w) != 1 || w[0] != 1062 {
		t.Fatalf("INSERT IGNORE of a duplicate: warnings %v, want [1062]", w)
	}
	if n, err := ins("INSERT", odku, "k1"); err != nil || n != 0 {
		t.Fatalf("ON DUPLICATE KEY UPDATE of a duplicate: %d %v", n, err)
	}
	if w := warnings(t, conn); len(w) != 0 {
		t.Fatalf("ON DUPLICATE KEY UPDATE of a duplicate: warnings %v, want none", w)
	}

	long := strings.Repeat("x", 512)
	if _, err := ins("INSERT", odku, long+"-a"); mysqlNumber(err) != 1406 {
		t.Fatalf("ON DUPLICATE KEY UPDATE of an over-long key: %v, want error 1406", err)
	}
	if n := e.count(t, "SELECT count(*) FROM "+s.Table()+" WHERE message_id LIKE 'xxx%'"); n != 0 {
		t.Fatalf("the refused key left %d rows", n)
	}
	// What the store avoids: IGNORE stores the first key truncated, and skips the second.
	if n, err := ins("INSERT IGNORE", "", long+"-a"); err != nil || n != 1 {
		t.Fatalf("INSERT IGNORE of an over-long key: %d %v", n, err)
	}
	if w := warnings(t, conn); len(w) != 1 || (w[0] != 1265 && w[0] != 1406) {
		t.Fatalf("INSERT IGNORE of an over-long key: warnings %v, want a truncation", w)
	}
	if n, err := ins("INSERT IGNORE", "", long+"-b"); err != nil || n != 0 {
		t.Fatalf("INSERT IGNORE of a second distinct over-long key: %d %v (want 0: merged)", n, err)
	}
	// The store itself refuses such a key before the server.
	if _, _, err := s.Claim(ctxT(t), plain(long+"-c")); !errors.Is(err, sqlstore.ErrKeyNotStorable) {
		t.Fatalf("store claim of an over-long key: %v, want ErrKeyNotStorable", err)
	}
}

// TestMySQLConcurrentDuplicateWaitsOnTheServer shows what the key's lock prevents: under
// InnoDB's REPEATABLE READ, an insert of a key another transaction inserted and has not
// committed waits on the server for its row lock, holding its connection, until
// innodb_lock_wait_timeout (error 1205).
func TestMySQLConcurrentDuplicateWaitsOnTheServer(t *testing.T) {
	e := newEnv(t, sqlstore.MySQL, 4)
	s := e.store(t, sqlstore.Config{})
	ctx := context.Background()
	a, err := e.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = a.Rollback() }()
	q := "INSERT INTO " + s.Table() + " (message_id, consumer_name) VALUES ('k', 'c') ON DUPLICATE KEY UPDATE message_id = message_id"
	if _, err := a.ExecContext(ctx, q); err != nil {
		t.Fatal(err)
	}
	conn, err := e.db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	if _, err := conn.ExecContext(ctx, "SET SESSION innodb_lock_wait_timeout = 1"); err != nil {
		t.Fatal(err)
	}
	b, err := conn.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.Rollback() }()
	start := time.Now()
	_, err = b.ExecContext(ctx, q)
	if mysqlNumber(err) != 1205 || time.Since(start) < 900*time.Millisecond {
		t.Fatalf("concurrent duplicate: %v after %s, want error 1205 after waiting about 1 s", err, time.Since(start))
	}
	if c := s.Classify(err); c != contract.Retryable {
		t.Fatalf("Classify(1205) = %d, want Retryable", c)
	}
}

// TestHeldKeyWaitsWithoutAConnection: copies of a key in flight wait in process, holding no
// connection (MySQL: GET_LOCK(name, 0) found taken; PostgreSQL: pg_try_advisory_xact_lock
// false), so a flood of copies does not starve other keys: with a pool of 3 connections, 6
// copies wait while another key is claimed and committed at once, and the copies end as
// duplicates once the first commits.
func TestHeldKeyWaitsWithoutAConnection(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		e := newEnv(t, d, 3)
		s := e.store(t, sqlstore.Config{})
		tx := mustClaim(t, s, plain("hot"), contract.Run)
		var wg sync.WaitGroup
		decisions := make(chan contract.Decision, 6)
		for range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				tx, c, err := s.Claim(ctxT(t), plain("hot"))
				if err != nil {
					t.Error(err)
					return
				}
				if tx != nil {
					_ = tx.Commit(context.Background())
				}
				decisions <- c.Decision
			}()
		}
		// A waiting copy holds a connection only for the moment of each try.
		busy := 0
		for range 20 {
			time.Sleep(10 * time.Millisecond)
			if e.db.Stats().InUse > 1 {
				busy++
			}
		}
		if busy >= 10 {
			t.Fatalf("more than the claim in flight's connection in use in %d of 20 samples while the copies wait", busy)
		}
		start := time.Now()
		other := mustClaim(t, s, plain("other"), contract.Run)
		if err := other.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
		if time.Since(start) > 2*time.Second {
			t.Fatalf("another key took %s beside the waiting copies", time.Since(start))
		}
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		close(decisions)
		for dec := range decisions {
			if dec != contract.Duplicate {
				t.Fatalf("a waiting copy decided %d, want Duplicate", dec)
			}
		}
		if n := processedRows(t, s); n != 2 {
			t.Fatalf("%d processed rows, want 2", n)
		}
	})
}

// TestMySQLDeadlockAndLockWaitAreRetryable provokes a real deadlock (1213) between two
// transactions that lock two rows in opposite orders, and a lock wait timeout (1205): both
// are Retryable. A deadlock rolls the whole transaction back (InnoDB), which the inbox then
// retries from the claim.
func TestMySQLDeadlockAndLockWaitAreRetryable(t *testing.T) {
	e := newEnv(t, sqlstore.MySQL, 4)
	s := e.store(t, sqlstore.Config{})
	e.exec(t, "CREATE TABLE accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL) ENGINE = InnoDB")
	e.exec(t, "INSERT INTO accounts VALUES (1, 0), (2, 0)")
	ctx := context.Background()
	a, _ := e.db.BeginTx(ctx, nil)
	b, _ := e.db.BeginTx(ctx, nil)
	defer func() { _ = a.Rollback(); _ = b.Rollback() }()
	upd := "UPDATE accounts SET balance = balance + 1 WHERE id = ?"
	if _, err := a.ExecContext(ctx, upd, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ExecContext(ctx, upd, 2); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	go func() { _, err := a.ExecContext(ctx, upd, 2); errs <- err }()
	time.Sleep(100 * time.Millisecond)
	go func() { _, err := b.ExecContext(ctx, upd, 1); errs <- err }()
	var deadlock error
	for range 2 {
		if err := <-errs; err != nil {
			deadlock = err
		}
	}
	if mysqlNumber(deadlock) != 1213 {
		t.Fatalf("want a deadlock (1213), got %v", deadlock)
	}
	for _, err := range []error{deadlock, fmt.Errorf("handler: %w", deadlock), &mysql.MySQLError{Number: 1205},
		&mysql.MySQLError{Number: 1020}, &mysql.MySQLError{Number: 3101}} {
		if c := s.Classify(err); c != contract.Retryable {
			t.Errorf("Classify(%v) = %d, want Retryable", err, c)
		}
	}
}

// TestConfigFaultsClassified: missing privileges, tables, databases and refused logins are
// the deployment's faults, each produced on the real server where it can be.
func TestConfigFaultsClassified(t *testing.T) {
	e := newEnv(t, sqlstore.MySQL, 4)
	s, err := sqlstore.New(e.db, sqlstore.Config{Dialect: sqlstore.MySQL}) // not migrated
	if err != nil {
		t.Fatal(err)
	}
	_, _, err = s.Claim(ctxT(t), plain("m1"))
	if mysqlNumber(err) != 1146 || s.Classify(err) != contract.ConfigFault {
		t.Fatalf("claim on a missing table: %v (class %d), want 1146, ConfigFault", err, s.Classify(err))
	}
	cfg, _ := mysql.ParseDSN(e.dsn)
	cfg.DBName = "no_such_database_" + e.schema
	_, err = sqlstore.Open(ctxT(t), sqlstore.MySQL, cfg.FormatDSN())
	if !errors.Is(err, sqlstore.ErrUnreachable) || mysqlNumber(err) != 1049 || s.Classify(err) != contract.ConfigFault {
		t.Fatalf("unknown database: %v, want ErrUnreachable, 1049, ConfigFault", err)
	}
	cfg.DBName, cfg.User, cfg.Passwd = e.schema, "no_such_user", "secret-password"
	_, err = sqlstore.Open(ctxT(t), sqlstore.MySQL, cfg.FormatDSN())
	if !errors.Is(err, sqlstore.ErrUnreachable) || mysqlNumber(err) != 1045 || s.Classify(err) != contract.ConfigFault {
		t.Fatalf("refused login: %v, want ErrUnreachable, 1045, ConfigFault", err)
	}
	if strings.Contains(err.Error(), "secret-password") {
		t.Fatalf("the error shows the password: %v", err)
	}
	for _, n := range []uint16{1142, 1143, 1044, 1054} {
		if c := s.Classify(&mysql.MySQLError{Number: n}); c != contract.ConfigFault {
			t.Errorf("Classify(%d) = %d, want ConfigFault", n, c)
		}
	}
	if c := s.Classify(&mysql.MySQLError{Number: 1062}); c != contract.Other {
		t.Errorf("Classify(1062) = %d, want Other", c)
	}
}

// TestPurgeDeletesInBoundedBatches: rows received before the cut are deleted, BatchSize per
// statement (MySQL: DELETE ... ORDER BY received_at LIMIT n), and newer rows stay.
func TestPurgeDeletesInBoundedBatches(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		e := newEnv(t, d, 4)
		s := e.store(t, sqlstore.Config{})
		for k := range 25 {
			tx := mustClaim(t, s, plain(fmt.Sprintf("old-%d", k)), contract.Run)
			if err := tx.Commit(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		age := "now() - interval '2 days'"
		if d == sqlstore.MySQL {
			age = "CURRENT_TIMESTAMP(6) - INTERVAL 2 DAY"
		}
		e.exec(t, "UPDATE "+s.Table()+" SET received_at = "+age)
		for k := range 5 {
			tx := mustClaim(t, s, plain(fmt.Sprintf("new-%d", k)), contract.Run)
			if err := tx.Commit(context.Background()); err != nil {
				t.Fatal(err)
			}
		}
		res, err := s.Purge(ctxT(t), sqlstore.PurgeParams{Before: time.Now().Add(-24 * time.Hour), BatchSize: 10})
		if err != nil {
			t.Fatal(err)
		}
		if res.Deleted != 25 || res.Batches != 3 {
			t.Fatalf("purge: %+v, want 25 rows in 3 batches", res)
		}
		if n := processedRows(t, s); n != 5 {
			t.Fatalf("%d rows left, want the 5 new ones", n)
		}
		mustClaim(t, s, plain("new-1"), contract.Duplicate)
	})
}

// keyLockName is the store's GET_LOCK name of a key (queries.go, lockName).
func keyLockName(schema, table string, k contract.Key) string {
	h := sha256.Sum256([]byte("watermill-inbox\x1f" + schema + "\x1f" + table + "\x1f" + k.ConsumerName + "\x1f" + k.MessageID))
	return "wi:" + hex.EncodeToString(h[:30])
}

// TestMySQLKeyLockReleasedOnEveryPath: GET_LOCK is held by the session, and the session goes
// back to the pool, so a lock left behind would block its key forever. After a commit, a
// failure, a duplicate, an exhausted claim, a dead-lettered one and a batch on a pool of two
// sessions (the claim's, and one for the count before the handler), no key's lock is held (IS_USED_LOCK from another session) and another store's
// sessions claim each key at once.
func TestMySQLKeyLockReleasedOnEveryPath(t *testing.T) {
	e := newEnv(t, sqlstore.MySQL, 4)
	owner := e.store(t, sqlstore.Config{})
	one := e.open(t, e.dsn, 2)
	s, err := sqlstore.New(one, owner.Config())
	if err != nil {
		t.Fatal(err)
	}
	counted := func(id string) contract.Delivery {
		d := plain(id)
		d.MaxAttempts, d.CountFirst = 1, true
		return d
	}
	tx := mustClaim(t, s, plain("committed"), contract.Run)
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, s, plain("committed"), contract.Duplicate)
	tx = mustClaim(t, s, counted("failed"), contract.Run)
	if _, err := tx.Fail(context.Background(), contract.Failure{Counts: true, Error: "boom"}); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, s, counted("failed"), contract.Exhausted)
	if err := s.MarkDeadLettered(ctxT(t), plain("dead").Key, "poison"); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, s, counted("dead"), contract.DeadLettered)
	bt, _, err := s.ClaimBatch(ctxT(t), []contract.Delivery{plain("b1"), plain("b2")})
	if err != nil {
		t.Fatal(err)
	}
	if err := bt.Rollback(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"committed", "failed", "dead", "b1", "b2"} {
		var holder sql.NullInt64
		if err := e.db.QueryRow("SELECT IS_USED_LOCK(?)", keyLockName(e.schema, sqlstore.DefaultTable, plain(id).Key)).Scan(&holder); err != nil {
			t.Fatal(err)
		}
		if holder.Valid {
			t.Fatalf("%s: its lock is still held by session %d", id, holder.Int64)
		}
	}
	tx = mustClaim(t, owner, plain("b1"), contract.Run)
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestMySQLKilledSessionReleasesItsClaim: the server ends a session in the middle of a
// handler (KILL CONNECTION: a crash of the consumer's connection). Its transaction rolls back
// and its GET_LOCK is released with the session, so the redelivery is claimed and run; the
// business write of the killed attempt is gone and the effect happens once.
func TestMySQLKilledSessionReleasesItsClaim(t *testing.T) {
	e := newEnv(t, sqlstore.MySQL, 6)
	s := e.store(t, sqlstore.Config{})
	e.exec(t, "CREATE TABLE accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL)")
	e.exec(t, "INSERT INTO accounts VALUES (1, 0)")
	tx := mustClaim(t, s, plain("m1"), contract.Run)
	htx, _ := sqlstore.TxFromContext(tx.Context(context.Background()))
	if _, err := htx.Exec("UPDATE accounts SET balance = balance + 100 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	var holder sql.NullInt64
	if err := e.db.QueryRow("SELECT IS_USED_LOCK(?)", keyLockName(e.schema, sqlstore.DefaultTable, plain("m1").Key)).Scan(&holder); err != nil || !holder.Valid {
		t.Fatalf("the claim's lock is not held: %v %v", holder, err)
	}
	e.exec(t, fmt.Sprintf("KILL CONNECTION %d", holder.Int64))
	if err := tx.Commit(context.Background()); err == nil {
		t.Fatal("commit on a killed session succeeded")
	}
	_, _ = tx.Fail(context.Background(), contract.Failure{})
	tx = mustClaim(t, s, plain("m1"), contract.Run)
	htx, _ = sqlstore.TxFromContext(tx.Context(context.Background()))
	if _, err := htx.Exec("UPDATE accounts SET balance = balance + 100 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	mustClaim(t, s, plain("m1"), contract.Duplicate)
	if got := e.count(t, "SELECT balance FROM accounts WHERE id = 1"); got != 100 {
		t.Fatalf("balance %d, want 100 (once)", got)
	}
}

// TestCountWithEveryConnectionInUse: a delivery that counts first needs a second connection
// for its count (a *sql.DB has no connection outside its pool, as pgstore's count has). On a
// pool of one, the count waits up to the finish timeout and the claim fails, saying how to
// size the pool, with nothing left open or counted: the same key is then claimed on a pool
// of two.
func TestCountWithEveryConnectionInUse(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		e := newEnv(t, d, 4)
		owner := e.store(t, sqlstore.Config{})
		s, err := sqlstore.New(e.open(t, e.dsn, 1), owner.Config())
		if err != nil {
			t.Fatal(err)
		}
		dl := plain("m1")
		dl.MaxAttempts, dl.CountFirst, dl.FinishTimeout = 3, true, 300*time.Millisecond
		tx, _, err := s.Claim(ctxT(t), dl)
		if err == nil || tx != nil || !strings.Contains(err.Error(), "size the pool") {
			t.Fatalf("claim on a pool of one: %v (Tx %v), want the count's pool error", err, tx != nil)
		}
		if n, ok := attemptsRow(t, owner, d, dl.Key); ok {
			t.Fatalf("%d attempts counted by the failed claim", n)
		}
		tx = mustClaim(t, owner, dl, contract.Run)
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
}

// TestMySQLPurgeIgnoresTheSessionTimeZone: received_at is a DATETIME written in the session's
// time zone. On sessions five hours behind UTC, fresh rows must survive a purge of rows older
// than an hour (a cut sent as a UTC time would fall five hours after their wall-clock time and
// delete them), and rows aged two hours by the server's clock go.
func TestMySQLPurgeIgnoresTheSessionTimeZone(t *testing.T) {
	e := newEnv(t, sqlstore.MySQL, 4)
	owner := e.store(t, sqlstore.Config{})
	behind := e.open(t, e.dsn+"?time_zone=%27-05%3A00%27", 4)
	s, err := sqlstore.New(behind, owner.Config())
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"fresh-1", "fresh-2", "old-1"} {
		tx := mustClaim(t, s, plain(id), contract.Run)
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := behind.Exec("UPDATE " + s.Table() + " SET received_at = received_at - INTERVAL 2 HOUR WHERE message_id = 'old-1'"); err != nil {
		t.Fatal(err)
	}
	res, err := s.Purge(ctxT(t), sqlstore.PurgeParams{Before: time.Now().Add(-time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	if res.Deleted != 1 || processedRows(t, s) != 2 {
		t.Fatalf("purge on a session 5 h behind UTC: %+v, %d rows left; want 1 deleted, 2 left", res, processedRows(t, s))
	}
}
