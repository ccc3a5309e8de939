//go:build unix

package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net/url"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

const (
	pollEvery = 10 * time.Millisecond
	// drainedFor is how long the inbox must be complete and the broker empty before the last
	// consumer is stopped, so deliveries it holds unacked (AMQP prefetch) are settled too.
	drainedFor = 300 * time.Millisecond
	// stopTimeout bounds the consumer's graceful stop (router CloseTimeout is 10 s).
	stopTimeout = 20 * time.Second
)

// demo is the orchestrator's state for one run.
type demo struct {
	o     options
	out   io.Writer
	runID string
	// schema holds everything of the run: the inbox, accounts and watermill-sql's tables.
	schema   string
	topic    string
	pool     *pgxpool.Pool
	store    *pgstore.Store
	accounts string // quoted, schema-qualified
	// schemaCreated: the schema exists, drop it on success, keep it on failure.
	schemaCreated bool
	broker        brokerAdmin
	w             *workload

	children int
	running  *child   // the last consumer started, killed on every exit path
	all      []*child // every consumer started
}

func runOrchestrator(o options) int {
	start := time.Now()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()

	d := &demo{o: o, out: os.Stdout}
	err := d.run(ctx, start)
	if d.running != nil {
		d.running.killAndWait()
	}
	if err == nil {
		err = d.cleanup()
	} else if d.schemaCreated {
		fmt.Fprintf(d.out, "kept        schema %s for inspection (drop it with: DROP SCHEMA %s CASCADE)\n", d.schema, d.schema)
	}
	if d.broker != nil {
		_ = d.broker.Close()
	}
	if d.pool != nil {
		d.pool.Close()
	}
	if err != nil {
		switch {
		case errors.Is(err, context.DeadlineExceeded):
			err = fmt.Errorf("%w (overall -timeout %s)", err, o.timeout)
		case errors.Is(err, context.Canceled):
			err = fmt.Errorf("%w (interrupted)", err)
		}
		fmt.Fprintf(d.out, "FAIL: %v\n", err)
		return 1
	}
	fmt.Fprintln(d.out, "OK")
	return 0
}

func (d *demo) run(ctx context.Context, start time.Time) error {
	var b [5]byte
	if _, err := rand.Read(b[:]); err != nil {
		return err
	}
	d.runID = hex.EncodeToString(b[:])
	d.schema = "billing_demo_" + d.runID
	d.topic = sqlTopic
	if d.o.broker == brokerAMQP {
		d.topic = "billing_demo_" + d.runID + "_payments" // the queue's name
	}
	seed := d.o.seed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	fmt.Fprintf(d.out, "billing demo: broker=%s schema=%s topic=%s seed=%d\n", d.o.broker, d.schema, d.topic, seed)

	pool, err := openPool(ctx, d.schema, "billing-demo-"+d.runID+"-orchestrator", 4)
	if err != nil {
		return err
	}
	d.pool = pool
	// Connect to the broker before creating anything, so an unreachable broker leaves no schema.
	logger := watermill.NopLogger{}
	if d.o.broker == brokerAMQP {
		b, err := newAMQPAdmin(d.topic, logger)
		if err != nil {
			return err
		}
		d.broker = b
	} else {
		b, err := newSQLAdmin(d.pool, d.schema, logger)
		if err != nil {
			return err
		}
		d.broker = b
	}
	if err := d.setup(ctx); err != nil {
		return err
	}
	w, err := newWorkload(mrand.New(mrand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), d.o.messages, d.o.accounts, d.o.dupRatio)
	if err != nil {
		return err
	}
	d.w = w
	unique := int64(len(w.ids))

	if err := d.broker.Publish(w.deliveries); err != nil {
		return err
	}
	fmt.Fprintf(d.out, "published   %d deliveries: %d unique payments over %d accounts + %d re-sent with the same UUID and payload\n",
		len(w.deliveries), unique, d.o.accounts, w.duplicates)

	consumeStart := time.Now()

	// 1. Crash after commit, before ack.
	k := max(1, len(w.ids)/4)
	c1, err := d.startConsumer(k)
	if err != nil {
		return err
	}
	if err := c1.wait(ctx); err != nil {
		return d.childFailure(c1, err)
	}
	if !c1.killedBySIGKILL() {
		return d.childFailure(c1, fmt.Errorf("consumer #1 should have SIGKILLed itself after its %s commit, but it exited: %s", ordinal(k), c1.describeExit()))
	}
	r1, ok := c1.report(lineCrash)
	if !ok {
		return d.childFailure(c1, errors.New("consumer #1 died without its CRASH report"))
	}
	rows1, err := d.inboxRows(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(d.out, "consumer #1 SIGKILLed itself right after the inbox committed its %s message, before the router acked it (processed %d, duplicates skipped %d); inbox rows %d/%d\n",
		ordinal(k), r1.Processed, r1.Duplicates, rows1, unique)

	// 2. Killed mid-stream, with a delivery inside its transaction.
	rows2, lockedAccount, err := d.killMidStream(ctx, rows1)
	if err != nil {
		return err
	}
	if rows2 >= unique {
		return fmt.Errorf("consumer #2 was killed after every payment was processed (%d/%d): the kill did not happen mid-stream", rows2, unique)
	}
	fmt.Fprintf(d.out, "consumer #2 SIGKILLed by the orchestrator mid-stream, with a delivery claimed but uncommitted (blocked on a row lock of account %d); committed %d; inbox rows %d/%d\n",
		lockedAccount, rows2-rows1, rows2, unique)

	// 3. Run to the end, stop gracefully.
	c3, completeAt, err := d.runToCompletion(ctx)
	if err != nil {
		return err
	}
	consumeTime := completeAt.Sub(consumeStart)
	r3, ok := c3.report(lineStats)
	if !ok {
		return d.childFailure(c3, errors.New("consumer #3 exited without its STATS report"))
	}
	fmt.Fprintf(d.out, "consumer #3 stopped with SIGTERM once the inbox was complete and the broker drained (processed %d, duplicates skipped %d, failed %d)\n",
		r3.Processed, r3.Duplicates, r3.Failed)
	pendingAfter, err := d.broker.Pending(ctx)
	if err != nil {
		return err
	}

	// Verify.
	// A consumer built with -race reports races on stderr; a SIGKILLed one has no exit status.
	for _, c := range d.all {
		if c.stderrContains("WARNING: DATA RACE") {
			return d.childFailure(c, fmt.Errorf("consumer #%d reported a data race", c.n))
		}
	}
	if err := d.verifyInbox(ctx, unique); err != nil {
		return err
	}
	fmt.Fprintf(d.out, "inbox rows  %d = %d unique message IDs, each published ID exactly once\n", unique, unique)
	total, err := d.verifyBalances(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(d.out, "balances    verified: %d/%d accounts equal the sum of their unique payments (%d cents in total)\n",
		d.o.accounts, d.o.accounts, total)
	fmt.Fprintf(d.out, "duplicates  %d deliveries skipped by the inbox, counted by consumers #1 and #3 (published duplicates and crash redeliveries; consumer #2's counters died with it)\n",
		r1.Duplicates+r3.Duplicates)
	fmt.Fprintf(d.out, "broker      %d left after the stop (%s)\n", pendingAfter, d.broker.PendingMeaning())
	fmt.Fprintf(d.out, "restarts    2 (consumer started 3 times; 2 crashes: after commit before ack, and mid-transaction)\n")
	secs := consumeTime.Seconds()
	fmt.Fprintf(d.out, "elapsed     %.1fs in total; consumers ran %.1fs: %.0f unique payments/s, %.0f published deliveries/s\n",
		time.Since(start).Seconds(), secs, float64(unique)/secs, float64(len(w.deliveries))/secs)
	return nil
}

// setup creates the run's schema, migrates the inbox into it and creates the accounts.
func (d *demo) setup(ctx context.Context) error {
	pool := d.pool
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{d.schema}.Sanitize()); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	d.schemaCreated = true
	var err error
	d.store, err = pgstore.New(pool, pgstore.Config{Schema: d.schema})
	if err != nil {
		return err
	}
	if _, err := d.store.Migrate(ctx); err != nil {
		return err
	}
	d.accounts = qualified(d.schema, "accounts")
	if _, err := pool.Exec(ctx, "CREATE TABLE "+d.accounts+" (id bigint PRIMARY KEY, balance bigint NOT NULL DEFAULT 0)"); err != nil {
		return fmt.Errorf("create accounts: %w", err)
	}
	if _, err := pool.Exec(ctx, "INSERT INTO "+d.accounts+" (id) SELECT generate_series(1, $1::bigint)", d.o.accounts); err != nil {
		return fmt.Errorf("insert accounts: %w", err)
	}
	return nil
}

func (d *demo) inboxRows(ctx context.Context) (int64, error) {
	var n int64
	err := d.pool.QueryRow(ctx, "SELECT count(*) FROM "+d.store.Table()+" WHERE consumer_name = $1", consumerName).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("count inbox rows: %w", err)
	}
	return n, nil
}

// killMidStream SIGKILLs a consumer mid-stream at a moment when one of its deliveries has
// claimed its message ID and waits inside its uncommitted transaction. To make that moment
// certain rather than lucky, on any machine and for any -messages:
//
//  1. Before the consumer starts, the orchestrator claims the last unprocessed payment L in a
//     transaction it keeps open (an uncommitted inbox row, as a second consumer instance
//     holding that message would). The consumer cannot finish: its claim of L waits.
//  2. Once the consumer has done a third of the remaining work, the orchestrator locks L's
//     account (SELECT ... FOR UPDATE) and rolls its claim of L back.
//  3. The consumer's next delivery for that account (L at the latest) claims its ID, runs its
//     UPDATE and waits on the lock. The orchestrator sees it in pg_stat_activity and kills.
//
// It returns the inbox rows counted just before the kill and the locked account.
func (d *demo) killMidStream(ctx context.Context, rowsBefore int64) (rows, account int64, err error) {
	unique := int64(len(d.w.ids))
	claimTx, last, err := d.holdLastClaim(ctx)
	if err != nil {
		return 0, 0, err
	}
	defer func() { _ = claimTx.Rollback(context.WithoutCancel(ctx)) }()
	account = d.w.accountOf[last]

	c, err := d.startConsumer(0)
	if err != nil {
		return 0, 0, err
	}
	fail := func(err error) (int64, int64, error) { return 0, 0, d.childFailure(c, err) }

	threshold := rowsBefore + (unique-rowsBefore)/3 // at most unique-1: reachable while L is held
	for rows < threshold {
		if c.exited() {
			return fail(fmt.Errorf("consumer #2 exited by itself: %s", c.describeExit()))
		}
		if err := sleep(ctx, pollEvery); err != nil {
			return fail(fmt.Errorf("waiting for consumer #2 to reach %d inbox rows (at %d): %w", threshold, rows, err))
		}
		if rows, err = d.inboxRows(ctx); err != nil {
			return fail(err)
		}
	}

	lockTx, err := d.pool.Begin(ctx)
	if err != nil {
		return fail(err)
	}
	defer func() { _ = lockTx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := lockTx.Exec(ctx, "SELECT 1 FROM "+d.accounts+" WHERE id = $1 FOR UPDATE", account); err != nil {
		return fail(fmt.Errorf("lock account %d: %w", account, err))
	}
	if err := claimTx.Rollback(ctx); err != nil {
		return fail(fmt.Errorf("release the claim of the last payment: %w", err))
	}

	for {
		if c.exited() {
			return fail(fmt.Errorf("consumer #2 exited by itself: %s", c.describeExit()))
		}
		var blocked int
		err := d.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock' AND query LIKE 'UPDATE %'`,
			d.consumerAppName(c.n)).Scan(&blocked)
		if err == nil && blocked > 0 {
			break
		}
		if err == nil {
			err = sleep(ctx, pollEvery)
		}
		if err != nil {
			return fail(fmt.Errorf("waiting for consumer #2 to block on account %d: %w", account, err))
		}
	}
	if rows, err = d.inboxRows(ctx); err != nil {
		return fail(err)
	}
	c.killAndWait()
	if !c.killedBySIGKILL() {
		return fail(fmt.Errorf("consumer #2 did not die of SIGKILL: %s", c.describeExit()))
	}
	// The killed consumer's blocked session gets the lock now, finds its client gone and rolls
	// back: it never received a COMMIT.
	if err := lockTx.Rollback(ctx); err != nil {
		return 0, 0, fmt.Errorf("release the lock on account %d: %w", account, err)
	}
	return rows, account, nil
}

// holdLastClaim opens a transaction that inserts the inbox row of the last-sent payment the
// inbox has not recorded yet, and leaves it uncommitted. It returns the transaction and the
// payment's index in d.w.ids.
func (d *demo) holdLastClaim(ctx context.Context) (pgx.Tx, int, error) {
	for range 10 {
		rows, err := d.pool.Query(ctx, "SELECT message_id FROM "+d.store.Table()+" WHERE consumer_name = $1", consumerName)
		if err != nil {
			return nil, 0, err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, 0, err
		}
		done := make(map[string]bool, len(ids))
		for _, id := range ids {
			done[id] = true
		}
		last := -1
		for i := len(d.w.ids) - 1; i >= 0 && last < 0; i-- {
			if !done[d.w.ids[i]] {
				last = i
			}
		}
		if last < 0 {
			return nil, 0, errors.New("every payment is already processed: no mid-stream kill possible")
		}
		tx, err := d.pool.Begin(ctx)
		if err != nil {
			return nil, 0, err
		}
		tag, err := tx.Exec(ctx, "INSERT INTO "+d.store.Table()+" (message_id, consumer_name) VALUES ($1, $2) ON CONFLICT DO NOTHING",
			d.w.ids[last], consumerName)
		if err == nil && tag.RowsAffected() == 1 {
			return tx, last, nil
		}
		_ = tx.Rollback(context.WithoutCancel(ctx))
		if err != nil {
			return nil, 0, fmt.Errorf("claim the last payment: %w", err)
		}
		// No consumer runs now, so this is not reached; retry anyway.
	}
	return nil, 0, errors.New("could not claim an unprocessed payment in 10 attempts")
}

// runToCompletion starts a consumer, waits until the inbox holds every unique message and the
// broker has nothing left for drainedFor, and stops it with SIGTERM. It returns the consumer and
// the time the work was found complete.
func (d *demo) runToCompletion(ctx context.Context) (*child, time.Time, error) {
	unique := int64(len(d.w.ids))
	c, err := d.startConsumer(0)
	if err != nil {
		return nil, time.Time{}, err
	}
	var completeSince time.Time
	var rows, pending int64
	for {
		if c.exited() {
			return nil, time.Time{}, d.childFailure(c, fmt.Errorf("consumer #3 exited by itself: %s", c.describeExit()))
		}
		if rows, err = d.inboxRows(ctx); err == nil {
			pending, err = d.broker.Pending(ctx)
		}
		if err != nil {
			return nil, time.Time{}, d.childFailure(c, fmt.Errorf("waiting for consumer #3 (inbox rows %d/%d, %d pending): %w", rows, unique, pending, err))
		}
		switch {
		case rows != unique || pending != 0:
			completeSince = time.Time{}
		case completeSince.IsZero():
			completeSince = time.Now()
		case time.Since(completeSince) >= drainedFor:
			c.signal(syscall.SIGTERM)
			stopCtx, cancel := context.WithTimeout(ctx, stopTimeout)
			defer cancel()
			if err := c.wait(stopCtx); err != nil {
				return nil, time.Time{}, d.childFailure(c, fmt.Errorf("graceful stop: %w", err))
			}
			if !c.state.Success() {
				return nil, time.Time{}, d.childFailure(c, fmt.Errorf("consumer #3 failed to stop gracefully: %s", c.describeExit()))
			}
			return c, completeSince, nil
		}
		if err := sleep(ctx, pollEvery); err != nil {
			return nil, time.Time{}, d.childFailure(c, fmt.Errorf("waiting for consumer #3 (inbox rows %d/%d, %d pending): %w", rows, unique, pending, err))
		}
	}
}

// verifyInbox checks that the inbox holds exactly the published IDs, once each.
func (d *demo) verifyInbox(ctx context.Context, unique int64) error {
	var rows, matching int64
	err := d.pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE message_id = ANY($2::text[]))
		FROM `+d.store.Table()+` WHERE consumer_name = $1`, consumerName, d.w.ids).Scan(&rows, &matching)
	if err != nil {
		return fmt.Errorf("verify inbox: %w", err)
	}
	if rows != unique || matching != unique {
		return fmt.Errorf("inbox has %d rows, %d of them published IDs; want %d", rows, matching, unique)
	}
	return nil
}

// verifyBalances compares every balance with the sum of its account's unique payments and
// returns the total.
func (d *demo) verifyBalances(ctx context.Context) (int64, error) {
	rows, err := d.pool.Query(ctx, "SELECT id, balance FROM "+d.accounts+" ORDER BY id")
	if err != nil {
		return 0, fmt.Errorf("read balances: %w", err)
	}
	type account struct{ ID, Balance int64 }
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[account])
	if err != nil {
		return 0, fmt.Errorf("read balances: %w", err)
	}
	var total int64
	var wrong []string
	for _, a := range got {
		want, ok := d.w.expected[a.ID]
		if !ok || a.Balance != want {
			wrong = append(wrong, fmt.Sprintf("account %d: balance %d, want %d (diff %+d)", a.ID, a.Balance, want, a.Balance-want))
		}
		total += a.Balance
	}
	if len(got) != len(d.w.expected) {
		wrong = append(wrong, fmt.Sprintf("%d accounts in the table, want %d", len(got), len(d.w.expected)))
	}
	if len(wrong) > 0 {
		sort.Strings(wrong)
		n := len(wrong)
		if n > 5 {
			wrong = append(wrong[:5], "...")
		}
		return 0, fmt.Errorf("%d balances are wrong: %s", n, strings.Join(wrong, "; "))
	}
	return total, nil
}

// cleanup deletes the run's queue (AMQP) and schema, after a successful run.
func (d *demo) cleanup() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.broker.Cleanup(ctx); err != nil {
		return fmt.Errorf("cleanup: %w", err)
	}
	if _, err := d.pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{d.schema}.Sanitize()+" CASCADE"); err != nil {
		return fmt.Errorf("cleanup: drop schema: %w", err)
	}
	return nil
}

// childFailure kills c and returns err after printing the tail of c's stderr.
func (d *demo) childFailure(c *child, err error) error {
	c.killAndWait()
	if tail := c.stderrTail(20); tail != "" {
		fmt.Fprintf(os.Stderr, "--- last lines of consumer #%d's stderr ---\n%s\n---\n", c.n, tail)
	}
	return err
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func ordinal(n int) string {
	suffix := "th"
	if n%100 < 11 || n%100 > 13 {
		switch n % 10 {
		case 1:
			suffix = "st"
		case 2:
			suffix = "nd"
		case 3:
			suffix = "rd"
		}
	}
	return fmt.Sprintf("%d%s", n, suffix)
}

// redactURL removes the password from a URL for messages.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparseable URL>"
	}
	return u.Redacted()
}
