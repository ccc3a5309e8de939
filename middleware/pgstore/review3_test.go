package pgstore_test

// Adversarial review of the storage contract v3 (the handler guard, the group count, the
// batch). Each test names the fault it shows; the ones that fail on the reviewed code say so.

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// review3Effects counts the rows of effects3 (no key: every write is a row) with id.
func review3Effects(t *testing.T, sch *testenv.Schema, id string) int {
	t.Helper()
	var n int
	if err := sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM effects3 WHERE id = $1", id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// review3Deliver runs one delivery of d the way the middleware does: claim; if Run, the
// handler; Commit, and Fail after a failed Commit or a handler error. It reports whether the
// delivery was acked (Commit nil, or a decision other than Run).
func review3Deliver(t *testing.T, s *pgstore.Store, d contract.Delivery, handler func(ctx context.Context, tx pgx.Tx) error) bool {
	t.Helper()
	ctx := context.Background()
	tx, c, err := s.Claim(ctx, d)
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	if c.Decision != contract.Run {
		return true
	}
	if herr := handler(ctx, handlerTx(t, tx)); herr != nil {
		_, _ = tx.Fail(ctx, contract.Failure{Counts: true, Error: herr.Error()})
		return false
	}
	if err := tx.Commit(ctx); err != nil {
		_, _ = tx.Fail(ctx, contract.Failure{Counts: true, Error: err.Error()})
		return false
	}
	return true
}

// TestReview3RollbackThenWriteInOneStringIsAppliedTwice: a handler sends, through the guarded
// transaction, one string "SELECT 1; ROLLBACK; INSERT ...". The guard only reads the leading
// keyword, and pgx sends an Exec without arguments in the simple protocol, which runs every
// statement of the string: the ROLLBACK ends the inbox transaction (the claim is gone) and the
// INSERT commits on its own. The inbox's Commit refuses (ErrTxEnded), the message is nacked,
// and its redelivery runs the handler again: the business write is applied twice.
//
// Fails on the reviewed code (2 effects, want at most 1).
func TestReview3RollbackThenWriteInOneStringIsAppliedTwice(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	s := sch.Store(t)
	sch.Exec(t, "CREATE TABLE effects3 (id text)")
	d := plain("m-rollback-string", "c")
	handler := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "SELECT 1; ROLLBACK; INSERT INTO effects3 VALUES ('m-rollback-string')")
		return err
	}
	for attempt := 0; attempt < 2; attempt++ {
		if review3Deliver(t, s, d, handler) {
			break
		}
	}
	if e := review3Effects(t, sch, d.Key.MessageID); e > 1 {
		t.Errorf("the business write was applied %d times: a statement of the handler's string ran outside the inbox transaction and the redelivery ran the handler again", e)
	}
}

// TestReview3NestedTransactionIsUnguarded: Begin on the handler's transaction returns pgx's
// own savepoint transaction over the inner, unguarded pgx.Tx. A ROLLBACK statement through it
// is not refused, it ends the inbox transaction, and a write after it commits on its own; the
// redelivery runs the handler again.
//
// Fails on the reviewed code (the ROLLBACK is sent; 2 effects).
func TestReview3NestedTransactionIsUnguarded(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	s := sch.Store(t)
	sch.Exec(t, "CREATE TABLE effects3 (id text)")
	d := plain("m-nested", "c")
	refused := true
	handler := func(ctx context.Context, tx pgx.Tx) error {
		nested, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := nested.Exec(ctx, "ROLLBACK"); err == nil {
			refused = false
		}
		_, err = nested.Exec(ctx, "INSERT INTO effects3 VALUES ('m-nested')")
		return err
	}
	for attempt := 0; attempt < 2; attempt++ {
		if review3Deliver(t, s, d, handler) {
			break
		}
	}
	if !refused {
		t.Error("a ROLLBACK statement through the nested transaction (tx.Begin) was sent: it ended the inbox transaction")
	}
	if e := review3Effects(t, sch, d.Key.MessageID); e > 1 {
		t.Errorf("the business write was applied %d times", e)
	}
}

// TestReview3LegitimateHandlerAPIs: what a well-behaved handler does through the guarded
// transaction works and commits with the claim: a nested transaction committed (RELEASE) and
// one rolled back (ROLLBACK TO), an explicit savepoint, CopyFrom, SendBatch, Prepare and its
// named statement, a large object, and statements without arguments.
func TestReview3LegitimateHandlerAPIs(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	s := sch.Store(t)
	sch.Exec(t, "CREATE TABLE effects3 (id text)")
	ctx := context.Background()
	for _, path := range claimPaths {
		t.Run(path.name, func(t *testing.T) {
			id := "legit-" + path.name
			d := path.delivery(plain(id, "c"))
			tx, _ := mustClaim(t, s, d, contract.Run)
			ptx := handlerTx(t, tx)
			must := func(what string, err error) {
				t.Helper()
				if err != nil {
					release(tx)
					t.Fatalf("%s: %v", what, err)
				}
			}
			n1, err := ptx.Begin(ctx)
			must("Begin", err)
			_, err = n1.Exec(ctx, "INSERT INTO effects3 VALUES ($1)", id)
			must("nested insert", err)
			must("nested Commit", n1.Commit(ctx))
			n2, err := ptx.Begin(ctx)
			must("Begin 2", err)
			_, err = n2.Exec(ctx, "INSERT INTO effects3 VALUES ('rolled-back')")
			must("nested insert 2", err)
			must("nested Rollback", n2.Rollback(ctx))
			_, err = ptx.Exec(ctx, "SAVEPOINT mine")
			must("SAVEPOINT", err)
			_, err = ptx.Exec(ctx, "INSERT INTO effects3 VALUES ('rolled-back')")
			must("insert after savepoint", err)
			_, err = ptx.Exec(ctx, "ROLLBACK TO SAVEPOINT mine")
			must("ROLLBACK TO SAVEPOINT", err)
			_, err = ptx.CopyFrom(ctx, pgx.Identifier{"effects3"}, []string{"id"}, pgx.CopyFromRows([][]any{{id}}))
			must("CopyFrom", err)
			b := &pgx.Batch{}
			b.Queue("INSERT INTO effects3 VALUES ($1)", id)
			b.Queue("INSERT INTO effects3 VALUES ($1)", id)
			must("SendBatch", ptx.SendBatch(ctx, b).Close())
			_, err = ptx.Prepare(ctx, "ins3", "INSERT INTO effects3 VALUES ($1)")
			must("Prepare", err)
			_, err = ptx.Exec(ctx, "ins3", id)
			must("prepared Exec", err)
			lo := ptx.LargeObjects()
			oid, err := lo.Create(ctx, 0)
			must("LargeObjects.Create", err)
			obj, err := lo.Open(ctx, oid, pgx.LargeObjectModeWrite)
			must("LargeObjects.Open", err)
			_, err = obj.Write([]byte("x"))
			must("LargeObject.Write", err)
			must("LargeObject.Close", obj.Close())
			for range 2 {
				_, err = ptx.Exec(ctx, "INSERT INTO effects3 VALUES ('"+id+"')") // no arguments: pgx's simple protocol
				must("insert without arguments", err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatalf("Commit: %v", err)
			}
			if e := review3Effects(t, sch, id); e != 7 {
				t.Errorf("%d effects, want 7", e)
			}
			if e := review3Effects(t, sch, "rolled-back"); e != 0 {
				t.Errorf("%d rolled-back effects, want 0", e)
			}
			if rows := claimRows(t, sch.Pool, s, id); rows != 1 {
				t.Errorf("%d claims, want 1", rows)
			}
			if _, ok := attemptsRow(t, sch.Pool, s, d.Key); ok {
				t.Error("the commit left the attempt record")
			}
		})
	}
}

// TestReview3BatchNeighbourCommitThenCrashLosesMember: in a batch of a and b, a's handler
// sends "SELECT 1; COMMIT" (the guard reads only the leading keyword). The COMMIT commits b's
// claim too, although b's handler has not run. The middleware repairs it in process
// (txEnded drops b's claim outside the transaction); a crash of the consumer between the
// handler's statement and that repair leaves b's claim committed without its work, and every
// redelivery of b is then a duplicate: b is acked, never processed. Here the crash is the
// batch abandoned (its connection closed) right after a's handler.
//
// Fails on the reviewed code (b's redelivery is a Duplicate).
func TestReview3BatchNeighbourCommitThenCrashLosesMember(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	s := sch.Store(t)
	sch.Exec(t, "CREATE TABLE effects3 (id text)")
	ctx := context.Background()
	ds := []contract.Delivery{plain("a-crash", "c"), plain("b-crash", "c")}
	bt, cs, err := s.ClaimBatch(ctx, ds)
	if err != nil {
		t.Fatal(err)
	}
	for k, c := range cs {
		if c.Decision != contract.Run {
			t.Fatalf("member %d: %s", k, decisionName(c.Decision))
		}
	}
	ptx := handlerTx(t, bt)
	if _, err := ptx.Exec(ctx, "INSERT INTO effects3 VALUES ('a-crash')"); err != nil {
		t.Fatal(err)
	}
	_, herr := ptx.Exec(ctx, "SELECT 1; COMMIT")
	// The crash: the consumer dies here; its connection goes away with it.
	_ = ptx.Conn().Close(ctx)
	_ = bt.Rollback(ctx)
	if herr != nil {
		t.Logf("the handler's string was refused: %v", herr)
	}
	tx, c, err := s.Claim(ctx, ds[1])
	if err != nil {
		t.Fatal(err)
	}
	if tx != nil {
		release(tx)
	}
	if c.Decision != contract.Run {
		t.Errorf("b's redelivery after the crash: %s, want Run (b's handler never ran; it would be acked unprocessed)", decisionName(c.Decision))
	}
}

// review3ProxiedStore is a store on sch whose pool reaches PostgreSQL through a fault-injection
// proxy, with application_name set to app.
func review3ProxiedStore(t *testing.T, sch *testenv.Schema, app string) (*pgstore.Store, *pgxpool.Pool, *testenv.Proxy) {
	t.Helper()
	p := testenv.NewProxy(t, testenv.DatabaseHostPort(t))
	u, err := url.Parse(testenv.WithHost(t, sch.URL, p.Addr))
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("application_name", app)
	u.RawQuery = q.Encode()
	pool := testenv.NewPool(t, u.String(), 4)
	s, err := pgstore.New(pool, pgstore.Config{Schema: sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	return s, pool, p
}

// TestReview3LostCountAnswerKeepsTheCount: the answer to the claim's round trip is lost after
// the server committed the count it carries (a network partition after the request). The
// claim fails and the handler never runs, so the count must not stay: a failed claim never
// counts, or MaxAttempts such faults dead-letter a healthy message that never ran.
//
// Failed on the reviewed code (1 attempt recorded, want 0).
func TestReview3LostCountAnswerKeepsTheCount(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	_ = sch.Store(t) // migrated
	s, _, p := review3ProxiedStore(t, sch, "review3-lost-count")
	ctx := context.Background()
	// Warm up: opens one pool connection through the proxy.
	mustCommit(t, s, countedFirst(plain("warm", "c"), true))
	p.Hold() // its answers are lost from now on; connections opened later are not held
	d := countedFirst(plain("victim", "c"), true)
	d.FinishTimeout = time.Second
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	tx, c, err := s.Claim(cctx, d)
	if tx != nil {
		release(tx)
		t.Fatalf("the claim was decided %s although the count's answer was lost", decisionName(c.Decision))
	}
	t.Logf("claim error (expected): %v", err)
	if err == nil {
		t.Fatal("the claim succeeded without a count answer")
	}
	if n, ok := attemptsRow(t, sch.Pool, s, d.Key); ok && n > 0 {
		t.Errorf("%d attempts recorded for a delivery whose claim failed before its handler ran (want 0: failed claims never count)", n)
	}
}

// TestReview3CountConnectionOutlivesThePool: every store opens its count connection outside
// its pool, and nothing closes it with the store or the pool; it stays until counterIdle
// (2 s). A test suite with one store per test, or an application that recreates stores,
// holds one connection per store beyond the pools' MaxConns for that long.
//
// Fails on the reviewed code (the count connections are still open after every pool closed).
func TestReview3CountConnectionOutlivesThePool(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	_ = sch.Store(t)
	const stores = 8
	app := "review3-leak-" + strings.ReplaceAll(sch.Name, "_", "-")
	var pools []*pgxpool.Pool
	var closers []*pgstore.Store
	for k := 0; k < stores; k++ {
		u, err := url.Parse(sch.URL)
		if err != nil {
			t.Fatal(err)
		}
		q := u.Query()
		q.Set("application_name", app)
		u.RawQuery = q.Encode()
		pool := testenv.NewPool(t, u.String(), 2)
		s, err := pgstore.New(pool, pgstore.Config{Schema: sch.Name})
		if err != nil {
			t.Fatal(err)
		}
		mustCommit(t, s, countedFirst(plain("leak-"+string(rune('a'+k)), "c"), true))
		pools = append(pools, pool)
		closers = append(closers, s)
	}
	for k, pool := range pools {
		_ = closers[k].Close() // the count connection, opened beside the pool
		pool.Close()
	}
	time.Sleep(200 * time.Millisecond)
	var open int
	if err := sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app).Scan(&open); err != nil {
		t.Fatal(err)
	}
	if open != 0 {
		t.Errorf("%d connections of %d closed stores are still open (the count connections, outside the pools)", open, stores)
	}
}

// TestReview3LostCountAnswersExhaustAHealthyMessage: the fault of
// TestReview3LostCountAnswerKeepsTheCount, MaxAttempts (3) times: the message's handler never
// ran, yet its next delivery is decided Exhausted (dead-lettered). A flaky network between
// the consumer and PostgreSQL dead-letters healthy messages.
//
// Fails on the reviewed code (Exhausted, want Run).
func TestReview3LostCountAnswersExhaustAHealthyMessage(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	_ = sch.Store(t)
	s, _, p := review3ProxiedStore(t, sch, "review3-lost-counts")
	ctx := context.Background()
	d := countedFirst(plain("healthy", "c"), true)
	d.FinishTimeout = time.Second
	for round := 0; round < d.MaxAttempts; round++ {
		mustCommit(t, s, countedFirst(plain("warm-"+string(rune('a'+round)), "c"), true))
		p.Hold()
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		tx, c, err := s.Claim(cctx, d)
		cancel()
		if tx != nil || err == nil {
			release(tx)
			t.Fatalf("round %d: the claim was decided %s without a count answer", round, decisionName(c.Decision))
		}
	}
	tx, c, err := s.Claim(ctx, d)
	if err != nil {
		t.Fatal(err)
	}
	release(tx)
	if c.Decision != contract.Run {
		t.Errorf("a message whose handler never ran was decided %s after %d lost count answers (attempts %d), want Run", decisionName(c.Decision), d.MaxAttempts, c.Attempts)
	}
}

// TestReview3RollbackBeginInOneStringAcksWithoutTheClaim: a handler sends, through the guarded
// transaction, "SELECT 1; ROLLBACK; BEGIN": the inbox transaction (with the claim) is gone and
// a new one is open, so the connection's status is "in a transaction" again and the guard,
// endedOn and Commit see nothing wrong. The handler's later writes commit with the inbox's
// COMMIT, the delivery is acked, and no claim is in the table: the next copy of the message
// runs the handler again.
//
// Fails on the reviewed code (Commit nil, no claim, 2 effects).
func TestReview3RollbackBeginInOneStringAcksWithoutTheClaim(t *testing.T) {
	for _, path := range claimPaths {
		t.Run(path.name, func(t *testing.T) {
			sch := testenv.NewSchema(t, 4)
			s := sch.Store(t)
			sch.Exec(t, "CREATE TABLE effects3 (id text)")
			d := path.delivery(plain("m-rb", "c"))
			handler := func(ctx context.Context, tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, "SELECT 1; ROLLBACK; BEGIN"); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, "INSERT INTO effects3 VALUES ($1)", "m-rb")
				return err
			}
			acked := review3Deliver(t, s, d, handler)
			rows := claimRows(t, sch.Pool, s, d.Key.MessageID)
			if acked && rows == 0 {
				t.Errorf("the delivery was acked (Commit nil) but its claim is not in the table")
			}
			// A copy of the message (a broker redelivery).
			review3Deliver(t, s, d, handler)
			if e := review3Effects(t, sch, "m-rb"); e > 1 {
				t.Errorf("the business write was applied %d times", e)
			}
		})
	}
}

// TestReview3BatchRollbackBeginInOneStringAcksWithoutClaims: the same in an optimistic batch of a and b:
// a's handler sends "SELECT 1; ROLLBACK; BEGIN" (everything before is gone, the claims of a
// and b with it), b's handler writes, Healthy is nil and the batch's Commit succeeds: both
// members would be acked, and neither claim is in the table.
//
// Fails on the reviewed code.
func TestReview3BatchRollbackBeginInOneStringAcksWithoutClaims(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	s := sch.Store(t)
	sch.Exec(t, "CREATE TABLE effects3 (id text)")
	ctx := context.Background()
	ds := []contract.Delivery{countedFirst(plain("a-rb", "c"), true), countedFirst(plain("b-rb", "c"), true)}
	bt, cs, err := s.ClaimBatch(ctx, ds)
	if err != nil {
		t.Fatal(err)
	}
	for k, c := range cs {
		if c.Decision != contract.Run {
			t.Fatalf("member %d: %s", k, decisionName(c.Decision))
		}
	}
	defer func() { _ = bt.Rollback(ctx) }()
	// The optimistic mode (BatchOptimistic, the default): no savepoint between members. (With
	// savepoints, b's SAVEPOINT after a's string fails and the batch rolls back.)
	for k, d := range ds {
		ptx := handlerTx(t, bt)
		if k == 0 {
			if _, err := ptx.Exec(ctx, "SELECT 1; ROLLBACK; BEGIN"); err != nil {
				t.Logf("the string was refused: %v", err)
				return // what the guard should do
			}
		}
		if _, err := ptx.Exec(ctx, "INSERT INTO effects3 VALUES ($1)", d.Key.MessageID); err != nil {
			t.Fatalf("member %d: %v", k, err)
		}
		if err := bt.Healthy(); err != nil {
			t.Logf("member %d: Healthy: %v", k, err)
			_ = bt.Rollback(ctx)
			return
		}
	}
	err = bt.Commit(ctx)
	for _, d := range ds {
		if rows := claimRows(t, sch.Pool, s, d.Key.MessageID); err == nil && rows == 0 {
			t.Errorf("%s: the batch's Commit succeeded (the member would be acked) but its claim is not in the table", d.Key.MessageID)
		}
	}
}

// TestReview3BatchDropDeletesACopysCommittedClaim: in a batch of a and b, a's handler sends
// "SELECT 1; ROLLBACK": the batch's claims are gone and the keys' locks free. A copy of b
// (waiting in process for b's key) claims it, runs and commits, with its business write. The
// batch then takes b out as the middleware does (txEnded: Drop(b) for a member whose handler
// has not run), and Drop, seeing the connection idle, deletes b's claim outside any
// transaction: the copy's committed claim. b's business write stays, its claim is gone, and
// b's next delivery runs the handler again.
//
// Fails on the reviewed code (0 claims for b after the Drop, 1 effect).
func TestReview3BatchDropDeletesACopysCommittedClaim(t *testing.T) {
	sch := testenv.NewSchema(t, 4)
	s := sch.Store(t)
	sch.Exec(t, "CREATE TABLE effects3 (id text)")
	ctx := context.Background()
	ds := []contract.Delivery{plain("a-drop", "c"), plain("b-drop", "c")}
	bt, cs, err := s.ClaimBatch(ctx, ds)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = bt.Rollback(ctx) }()
	for k, c := range cs {
		if c.Decision != contract.Run {
			t.Fatalf("member %d: %s", k, decisionName(c.Decision))
		}
	}
	if _, err := handlerTx(t, bt).Exec(ctx, "SELECT 1; ROLLBACK"); err != nil {
		t.Logf("the string was refused: %v", err)
		return // what the guard should do
	}
	// The copy of b.
	tx, _ := mustClaim(t, s, ds[1], contract.Run)
	if _, err := handlerTx(t, tx).Exec(ctx, "INSERT INTO effects3 VALUES ('b-drop')"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// The coordinator: a's handler returned nil; Healthy says the transaction ended; b, whose
	// handler has not run, is taken out.
	if err := bt.Healthy(); err == nil {
		t.Fatal("Healthy after the handler's ROLLBACK: nil")
	}
	if _, err := bt.Drop(ctx, 1, contract.Failure{}); err != nil {
		t.Fatalf("Drop(b): %v", err)
	}
	_ = bt.Rollback(ctx)
	if rows, e := claimRows(t, sch.Pool, s, "b-drop"), review3Effects(t, sch, "b-drop"); rows != 1 {
		t.Errorf("b: %d claims, %d effects after the batch's Drop: the copy's committed claim was deleted, and b's next delivery runs its handler again", rows, e)
	}
}
