//go:build unix

package main

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"io"
	mrand "math/rand/v2"
	"net/url"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/router"
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
	// schema holds everything of the run: the inbox, the outbox, the business tables and
	// watermill-sql's tables.
	schema string
	topics topics
	// st is the run's database (-db, storage.go); pool is its PostgreSQL pool (nil on
	// mysql), which the postgres broker, the store-then-process mode and the soak use.
	st   *storage
	pool *pgxpool.Pool
	// shards are the databases of shards 1..N-1 with -shards (shard 0 is st); shardDBs
	// their names, once created (shards.go).
	shards   []*storage
	shardDBs []string
	// accounts, rejections, receipts: the business tables, quoted, schema-qualified.
	accounts, rejections, receipts string
	// deferredTable is the store-then-process table, quoted (-mode=store-then-process only).
	deferredTable string
	// schemaCreated: the schema exists, drop it on success, keep it on failure.
	schemaCreated bool
	broker        *brokerAdmin
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
		fmt.Fprintf(d.out, "kept        %s\n", d.st.keptHint())
		for _, name := range d.shardDBs {
			fmt.Fprintf(d.out, "kept        database %s for inspection (drop it with: DROP DATABASE %s WITH (FORCE))\n", name, name)
		}
	}
	closeAll(d.shards)
	if d.broker != nil {
		d.broker.Close()
	}
	if d.st != nil {
		d.st.close()
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
	seed, err := d.prepare(ctx)
	if err != nil {
		return err
	}
	switch {
	case d.o.mode == router.ModeStoreThenProcess:
		return d.runDeferred(ctx, start)
	case d.o.soak:
		return d.soak(ctx, start, mrand.New(mrand.NewPCG(seed^0x5eed, seed)))
	}
	return d.runImmediate(ctx, start)
}

// prepare names the run, connects to PostgreSQL and the broker, creates the schema, the
// tables and the topics, builds the workload and publishes its deliveries. It returns the
// workload's seed.
func (d *demo) prepare(ctx context.Context) (uint64, error) {
	var b [5]byte
	if _, err := rand.Read(b[:]); err != nil {
		return 0, err
	}
	d.runID = hex.EncodeToString(b[:])
	d.schema = "billing_demo_" + d.runID
	d.topics = runTopics(d.o.broker, d.runID)
	seed := d.o.seed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	fmt.Fprintf(d.out, "billing demo: broker=%s schema=%s topic=%s seed=%d\n", d.o.broker, d.schema, d.topics.payments, seed)
	switch d.o.db {
	case dbPgSQL:
		fmt.Fprintf(d.out, "database    PostgreSQL through database/sql: sqlstore's PostgreSQL dialect, the handler on a *sql.Tx\n")
	case dbMySQL:
		fmt.Fprintf(d.out, "database    MySQL/MariaDB database %s: sqlstore's MySQL dialect (balances, business tables, inbox, outbox), the handler on a *sql.Tx\n", d.schema)
	}
	if d.o.mode != router.ModeImmediate {
		fmt.Fprintf(d.out, "mode        %s: the receipt stores each delivery and acks it; workers run the billing handler later, each account's payments in sequence order\n", d.o.mode)
	}

	st, err := openStorage(ctx, d.o.db, d.schema, "billing-demo-"+d.runID+"-orchestrator", 4, true)
	if err != nil {
		return 0, err
	}
	d.st, d.pool = st, st.pool
	d.schemaCreated = st.created
	// Connect to the broker before creating anything, so an unreachable broker leaves no
	// schema. The postgres adapter creates its tables on first use, in the run's schema.
	if d.broker, err = newBrokerAdmin(d.o, d.pool, d.schema, d.topics); err != nil {
		return 0, err
	}
	if err := d.setup(ctx); err != nil {
		return 0, err
	}
	if d.o.sharded() {
		if err := d.createShards(ctx); err != nil {
			return 0, err
		}
	}
	if d.o.mode == router.ModeStoreThenProcess {
		if err := d.setupDeferred(ctx); err != nil {
			return 0, err
		}
	}
	if err := d.broker.createTopics(); err != nil {
		return 0, err
	}
	w, err := newWorkload(mrand.New(mrand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), d.o.messages, d.o.accounts, d.o.dupRatio, d.o.poison,
		d.o.mode == router.ModeStoreThenProcess)
	if err != nil {
		return 0, err
	}
	d.w = w
	if d.o.sharded() {
		w.tagShards(d.o.shards)
	}
	if err := d.broker.Publish(w.deliveries); err != nil {
		return 0, err
	}
	fmt.Fprintf(d.out, "published   %d deliveries: %d unique payments over %d accounts + %d re-sent with the same UUID and payload\n",
		len(w.deliveries), len(w.ids), d.o.accounts, w.duplicates)
	return seed, nil
}

// runImmediate is run's sequel in the immediate mode, once the payments are published: four
// consumers (three crashes, then one run to the end), then the checks.
func (d *demo) runImmediate(ctx context.Context, start time.Time) error {
	w := d.w
	unique := int64(len(w.ids))
	consumeStart := time.Now()

	// 1. Crash after commit, before ack.
	r1, rows1, err := d.crashAfterCommit(ctx)
	if err != nil {
		return err
	}

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

	// 3. Poison payments; a crash between two of one's attempts.
	r3, err := d.poisonWithCrash(ctx)
	if err != nil {
		return err
	}

	// 4. Run to the end, stop gracefully.
	r4, completeAt, pendingAfter, err := d.lastConsumer(ctx)
	if err != nil {
		return err
	}
	consumeTime := completeAt.Sub(consumeStart)

	if err := d.verifyImmediate(ctx, r1.ReceiptsDuplicates+r3.ReceiptsDuplicates+r4.ReceiptsDuplicates); err != nil {
		return err
	}
	fmt.Fprintf(d.out, "duplicates  %d deliveries skipped by the billing inbox, counted by consumers #1, #3 and #4 (published duplicates and crash redeliveries; consumer #2's counters died with it)\n",
		r1.Duplicates+r3.Duplicates+r4.Duplicates)
	fmt.Fprintf(d.out, "broker      %d left after the stop (%s)\n", pendingAfter, d.broker.pendingMeaning)
	fmt.Fprintf(d.out, "restarts    3 (consumer started 4 times; 3 crashes: after commit before ack, mid-transaction, inside a poison payment's handler)\n")
	d.printElapsed(start, consumeTime)
	return nil
}

// crashAfterCommit runs consumer #1 until it SIGKILLs itself right after the inbox committed
// its -messages/4th message, before the router acked it. It returns its CRASH report and the
// inbox rows counted after its death.
func (d *demo) crashAfterCommit(ctx context.Context) (consumerReport, int64, error) {
	k := max(1, len(d.w.ids)/4)
	c1, err := d.startConsumer(crashPoint{afterCommits: k})
	if err != nil {
		return consumerReport{}, 0, err
	}
	if err := c1.wait(ctx); err != nil {
		return consumerReport{}, 0, d.childFailure(c1, err)
	}
	if !c1.killedBySIGKILL() {
		return consumerReport{}, 0, d.childFailure(c1, fmt.Errorf("consumer #1 should have SIGKILLed itself after its %s commit, but it exited: %s", ordinal(k), c1.describeExit()))
	}
	r1, ok := c1.report(lineCrash)
	if !ok {
		return consumerReport{}, 0, d.childFailure(c1, errors.New("consumer #1 died without its CRASH report"))
	}
	rows1, err := d.inboxRows(ctx)
	if err != nil {
		return consumerReport{}, 0, err
	}
	fmt.Fprintf(d.out, "consumer #1 SIGKILLed itself right after the inbox committed its %s message, before the router acked it (processed %d, duplicates skipped %d); inbox rows %d/%d\n",
		ordinal(k), r1.Processed, r1.Duplicates, rows1, len(d.w.ids))
	return r1, rows1, nil
}

// poisonWithCrash publishes the poison payments and runs consumer #3 until it SIGKILLs itself
// inside a poison payment's handler, then checks that the inbox counted exactly the handler
// runs of that payment. It returns the consumer's CRASH report.
func (d *demo) poisonWithCrash(ctx context.Context) (consumerReport, error) {
	w := d.w
	if err := d.broker.Publish(w.poison); err != nil {
		return consumerReport{}, err
	}
	fmt.Fprintf(d.out, "published   %d payments to frozen account %d: poison messages, which the handler rejects on every attempt with an ordinary error\n",
		len(w.poison), w.frozenAccount)
	r3, err := d.crashInPoison(ctx)
	if err != nil {
		return consumerReport{}, err
	}
	attempts3, err := d.attemptsOf(ctx, r3.Rejected)
	if err != nil {
		return consumerReport{}, err
	}
	if attempts3 != r3.RejectedRun {
		return consumerReport{}, fmt.Errorf("poison payment %s: the inbox counted %d attempts for %d handler runs", r3.Rejected, attempts3, r3.RejectedRun)
	}
	fmt.Fprintf(d.out, "consumer #3 SIGKILLed itself in the handler of poison payment %s, on its attempt %d of %d (rejection logged, transaction open); its inbox attempts row says %d\n",
		r3.Rejected, r3.RejectedRun, d.o.maxAttempts, attempts3)
	return r3, nil
}

// lastConsumer runs consumer #4 to the end and stops it gracefully. It returns its STATS
// report, the time the work was found complete and what the broker holds after the stop.
func (d *demo) lastConsumer(ctx context.Context) (consumerReport, time.Time, int64, error) {
	c4, completeAt, err := d.runToCompletion(ctx)
	if err != nil {
		return consumerReport{}, time.Time{}, 0, err
	}
	r4, ok := c4.report(lineStats)
	if !ok {
		return consumerReport{}, time.Time{}, 0, d.childFailure(c4, errors.New("consumer #4 exited without its STATS report"))
	}
	fmt.Fprintf(d.out, "consumer #4 stopped with SIGTERM once every payment was processed or dead-lettered, every receipt counted and the broker drained (processed %d, duplicates skipped %d, dead-lettered %d, failed %d)\n",
		r4.Processed, r4.Duplicates, r4.DeadLettered, r4.Failed)
	if r4.DedupHitRate != nil && r4.ClaimP99 != nil {
		fmt.Fprintf(d.out, "metrics     consumer #4 alone (the last one started, so its deliveries only, not the run's), from its Prometheus histograms: dedup hit rate %.1f%% (duplicates / deliveries), claim p99 %.2f ms\n",
			100**r4.DedupHitRate, 1000**r4.ClaimP99)
	}
	pendingAfter, err := d.broker.Pending(ctx)
	if err != nil {
		return consumerReport{}, time.Time{}, 0, err
	}
	return r4, completeAt, pendingAfter, nil
}

// verifyImmediate checks the immediate mode's end state and prints each check: no consumer
// reported a data race, the inbox holds each published ID once, every balance, the poison
// payments' dead letters and the receipts. receiptsDuplicates is what the receipts inbox
// skipped, as the consumers that lived to report it counted.
func (d *demo) verifyImmediate(ctx context.Context, receiptsDuplicates uint64) error {
	w := d.w
	unique := int64(len(w.ids))
	if err := d.checkRaces(); err != nil {
		return err
	}
	if err := d.verifyInbox(ctx, unique); err != nil {
		return err
	}
	fmt.Fprintf(d.out, "inbox rows  %d = %d unique message IDs, each published ID exactly once\n", unique, unique)
	total, err := d.verifyBalances(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(d.out, "balances    verified: %d/%d accounts equal the sum of their unique payments (%d cents in total); frozen account %d: 0\n",
		d.o.accounts, d.o.accounts, total, w.frozenAccount)
	if d.o.sharded() {
		fmt.Fprintf(d.out, "shards      verified on each of the %d databases: every account's payments on its own shard (account mod %d), 0 on the others; each inbox row on its payment's shard\n",
			d.o.shards, d.o.shards)
	}
	runs, err := d.verifyPoison(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(d.out, "poison      dead-lettered %d/%d after %d attempts each: each once on topic %s, its attempts row at %d and dead-lettered; handler ran %d times, %d per payment (%s); no balance changed\n",
		len(w.poisonIDs), len(w.poisonIDs), d.o.maxAttempts, d.topics.deadLetters, d.o.maxAttempts, runs.total, d.o.maxAttempts, runs.byConsumer())
	if err := d.verifyReceipts(ctx, unique, total); err != nil {
		return err
	}
	fmt.Fprintf(d.out, "receipts    counted %d = %d unique payments, one each, by the receipts inbox; it skipped %d duplicates (relay republishes and crash redeliveries, counted by consumers #1, #3 and #4)\n",
		unique, unique, receiptsDuplicates)
	return nil
}

// checkRaces fails when a consumer reported a data race: one built with -race reports races
// on stderr (a SIGKILLed one has no exit status).
func (d *demo) checkRaces() error {
	for _, c := range d.all {
		if c.stderrContains("WARNING: DATA RACE") {
			return d.childFailure(c, fmt.Errorf("consumer #%d reported a data race", c.n))
		}
	}
	return nil
}

// printElapsed prints the run's elapsed line: the time since start, and the time the
// consumers ran with the rates it gives.
func (d *demo) printElapsed(start time.Time, consumeTime time.Duration) {
	secs := consumeTime.Seconds()
	fmt.Fprintf(d.out, "elapsed     %.1fs in total; consumers ran %.1fs: %.0f unique payments/s, %.0f published deliveries/s\n",
		time.Since(start).Seconds(), secs, float64(len(d.w.ids))/secs, float64(len(d.w.deliveries))/secs)
}

// setup creates the run's schema, migrates the inbox and creates the outbox in it, and creates
// the business tables: the accounts (one more than -accounts, frozen), the rejection log and
// the receipts counted downstream.
func (d *demo) setup(ctx context.Context) error {
	d.accounts = d.st.table("accounts")
	d.rejections = d.st.table("rejections")
	d.receipts = d.st.table("receipts")
	err := d.st.setup(ctx, d.accounts, d.rejections, d.receipts, d.o.accounts)
	d.schemaCreated = d.st.created
	return err
}

func (d *demo) inboxRows(ctx context.Context) (int64, error) {
	var total int64
	for _, st := range d.dbs() {
		var n int64
		err := st.db.QueryRowContext(ctx, st.q("SELECT count(*) FROM "+st.inboxTable+" WHERE consumer_name = $1"), consumerName).Scan(&n)
		if err != nil {
			return 0, fmt.Errorf("count inbox rows: %w", err)
		}
		total += n
	}
	return total, nil
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
	defer func() { _, _ = claimTx.Fail(context.WithoutCancel(ctx), contract.Failure{}) }()
	account = d.w.accountOf[last]

	c, err := d.startConsumer(crashPoint{})
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

	lockDB := d.storageOf(account)
	lockTx, err := lockDB.db.BeginTx(ctx, nil)
	if err != nil {
		return fail(err)
	}
	defer func() { _ = lockTx.Rollback() }()
	var one int
	if err := lockTx.QueryRowContext(ctx, lockDB.q("SELECT 1 FROM "+d.accounts+" WHERE id = $1 FOR UPDATE"), account).Scan(&one); err != nil {
		return fail(fmt.Errorf("lock account %d: %w", account, err))
	}
	if _, err := claimTx.Fail(ctx, contract.Failure{}); err != nil {
		return fail(fmt.Errorf("release the claim of the last payment: %w", err))
	}

	for {
		if c.exited() {
			return fail(fmt.Errorf("consumer #2 exited by itself: %s", c.describeExit()))
		}
		blocked, err := d.st.lockWaiting(ctx, d.consumerAppName(c.n))
		if err == nil && blocked {
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
	if err := lockTx.Rollback(); err != nil {
		return 0, 0, fmt.Errorf("release the lock on account %d: %w", account, err)
	}
	return rows, account, nil
}

// holdLastClaim claims, through the store as a consumer would (so the key's lock is held too),
// the last-sent payment the inbox has not recorded yet, and leaves the claim uncommitted. It
// returns the claim's transaction and the payment's index in d.w.ids.
func (d *demo) holdLastClaim(ctx context.Context) (contract.Tx, int, error) {
	for range 10 {
		ids, err := d.processedIDs(ctx)
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
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		tx, res, err := d.storageOf(d.w.accountOf[last]).store.Claim(cctx, contract.Delivery{Key: inbox.Key{MessageID: d.w.ids[last], ConsumerName: consumerName}})
		cancel()
		if err == nil && res.Decision == contract.Run {
			return tx, last, nil
		}
		if err != nil && !errClaimInFlight(err) {
			return nil, 0, fmt.Errorf("claim the last payment: %w", err)
		}
		// No consumer runs now, so this is not reached; retry anyway.
	}
	return nil, 0, errors.New("could not claim an unprocessed payment in 10 attempts")
}

// crashInPoison runs a consumer until it SIGKILLs itself inside the handler of a poison payment,
// on its second-to-last attempt, and returns its CRASH report.
func (d *demo) crashInPoison(ctx context.Context) (consumerReport, error) {
	c, err := d.startConsumer(crashPoint{onRejection: d.o.maxAttempts - 1})
	if err != nil {
		return consumerReport{}, err
	}
	if err := c.wait(ctx); err != nil {
		return consumerReport{}, d.childFailure(c, err)
	}
	if !c.killedBySIGKILL() {
		return consumerReport{}, d.childFailure(c, fmt.Errorf("consumer #%d should have SIGKILLed itself in a poison payment's handler, but it exited: %s", c.n, c.describeExit()))
	}
	r, ok := c.report(lineCrash)
	if !ok || r.Rejected == "" {
		return consumerReport{}, d.childFailure(c, fmt.Errorf("consumer #%d died without its CRASH report", c.n))
	}
	return r, nil
}

// attemptsOf returns the billing inbox's attempt count of a message (0 without a row).
func (d *demo) attemptsOf(ctx context.Context, messageID string) (int64, error) {
	var total int64
	for _, st := range d.dbs() { // with -shards, only the message's shard has a row
		var n int64
		err := st.db.QueryRowContext(ctx, st.q("SELECT coalesce(max(attempts), 0) FROM "+st.attemptsTable+" WHERE message_id = $1 AND consumer_name = $2"),
			messageID, consumerName).Scan(&n)
		if err != nil {
			return 0, fmt.Errorf("read attempts: %w", err)
		}
		total += n
	}
	return total, nil
}

// processedIDs returns the message IDs the billing inbox recorded.
func (d *demo) processedIDs(ctx context.Context) ([]string, error) {
	var all []string
	for k := range d.dbs() {
		ids, err := d.processedIDsOn(ctx, k)
		if err != nil {
			return nil, err
		}
		all = append(all, ids...)
	}
	return all, nil
}

// processedIDsOn returns the message IDs the billing inbox recorded on database k of d.dbs().
func (d *demo) processedIDsOn(ctx context.Context, k int) ([]string, error) {
	st := d.dbs()[k]
	rows, err := st.db.QueryContext(ctx, st.q("SELECT message_id FROM "+st.inboxTable+" WHERE consumer_name = $1"), consumerName)
	if err != nil {
		return nil, err
	}
	return collect(rows, func(r *sql.Rows) (id string, err error) { return id, r.Scan(&id) })
}

// collect scans every row of rows with scan, and closes rows.
func collect[T any](rows *sql.Rows, scan func(*sql.Rows) (T, error)) ([]T, error) {
	defer func() { _ = rows.Close() }()
	var out []T
	for rows.Next() {
		v, err := scan(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// progress is what the orchestrator waits for before it stops the last consumer.
type progress struct {
	rows, pending, deadLettered, receipts int64
}

func (d *demo) progress(ctx context.Context) (progress, error) {
	var p progress
	err := d.st.db.QueryRowContext(ctx, d.st.q(`SELECT
		(SELECT count(*) FROM `+d.st.inboxTable+` WHERE consumer_name = $1),
		(SELECT count(*) FROM `+d.st.attemptsTable+` WHERE consumer_name = $2 AND dead_lettered_at IS NOT NULL),
		(SELECT count(*) FROM `+d.receipts+`)`), consumerName, consumerName).Scan(&p.rows, &p.deadLettered, &p.receipts)
	if err != nil {
		return p, fmt.Errorf("read progress: %w", err)
	}
	for _, st := range d.shards {
		var rows, dead int64
		if err := st.db.QueryRowContext(ctx, st.q(`SELECT
		(SELECT count(*) FROM `+st.inboxTable+` WHERE consumer_name = $1),
		(SELECT count(*) FROM `+st.attemptsTable+` WHERE consumer_name = $2 AND dead_lettered_at IS NOT NULL)`), consumerName, consumerName).Scan(&rows, &dead); err != nil {
			return p, fmt.Errorf("read progress: %w", err)
		}
		p.rows, p.deadLettered = p.rows+rows, p.deadLettered+dead
	}
	p.pending, err = d.broker.Pending(ctx)
	return p, err
}

func (p progress) String() string {
	return fmt.Sprintf("inbox rows %d, dead-lettered %d, receipts %d, %d pending", p.rows, p.deadLettered, p.receipts, p.pending)
}

// runToCompletion starts a consumer, waits until the inbox holds every unique payment, every
// poison payment is dead-lettered, every receipt is counted and the broker has nothing left,
// all for drainedFor, and stops it with SIGTERM. It returns the consumer and the time the work
// was found complete.
func (d *demo) runToCompletion(ctx context.Context) (*child, time.Time, error) {
	unique, poison := int64(len(d.w.ids)), int64(len(d.w.poisonIDs))
	c, err := d.startConsumer(crashPoint{})
	if err != nil {
		return nil, time.Time{}, err
	}
	var completeSince time.Time
	for {
		if c.exited() {
			return nil, time.Time{}, d.childFailure(c, fmt.Errorf("consumer #%d exited by itself: %s", c.n, c.describeExit()))
		}
		p, err := d.progress(ctx)
		if err != nil {
			return nil, time.Time{}, d.childFailure(c, fmt.Errorf("waiting for consumer #%d: %w", c.n, err))
		}
		switch {
		case p.receipts > unique:
			return nil, time.Time{}, d.childFailure(c, fmt.Errorf("%d receipts counted for %d unique payments", p.receipts, unique))
		case p.deadLettered > poison:
			return nil, time.Time{}, d.childFailure(c, fmt.Errorf("%d payments dead-lettered, but only %d are poison", p.deadLettered, poison))
		}
		switch {
		case p.rows != unique || p.deadLettered != poison || p.receipts != unique || p.pending != 0:
			completeSince = time.Time{}
		case completeSince.IsZero():
			completeSince = time.Now()
		case time.Since(completeSince) >= drainedFor:
			c.stop()
			stopCtx, cancel := context.WithTimeout(ctx, stopTimeout)
			defer cancel()
			if err := c.wait(stopCtx); err != nil {
				return nil, time.Time{}, d.childFailure(c, fmt.Errorf("graceful stop: %w", err))
			}
			if !c.state.Success() {
				return nil, time.Time{}, d.childFailure(c, fmt.Errorf("consumer #%d failed to stop gracefully: %s", c.n, c.describeExit()))
			}
			return c, completeSince, nil
		}
		if err := sleep(ctx, pollEvery); err != nil {
			return nil, time.Time{}, d.childFailure(c, fmt.Errorf("waiting for consumer #%d (%s; want %d, %d, %d, 0): %w", c.n, p, unique, poison, unique, err))
		}
	}
}

// verifyInbox checks that the inbox holds exactly the published IDs, once each.
func (d *demo) verifyInbox(ctx context.Context, unique int64) error {
	ids, err := d.processedIDs(ctx)
	if err != nil {
		return fmt.Errorf("verify inbox: %w", err)
	}
	published := make(map[string]bool, len(d.w.ids))
	for _, id := range d.w.ids {
		published[id] = true
	}
	rows, matching := int64(len(ids)), int64(0)
	for _, id := range ids {
		if published[id] {
			matching++
		}
	}
	if rows != unique || matching != unique {
		return fmt.Errorf("inbox has %d rows, %d of them published IDs; want %d", rows, matching, unique)
	}
	if !d.o.sharded() {
		return nil
	}
	// Each ID on its own shard's database only.
	accountOf := make(map[string]int64, len(d.w.ids))
	for i, id := range d.w.ids {
		accountOf[id] = d.w.accountOf[i]
	}
	for k := range d.dbs() {
		ids, err := d.processedIDsOn(ctx, k)
		if err != nil {
			return fmt.Errorf("verify inbox: %w", err)
		}
		for _, id := range ids {
			if want := shardOf(accountOf[id], d.o.shards); want != k {
				return fmt.Errorf("shard %d's inbox holds %s, a payment to account %d of shard %d", k, id, accountOf[id], want)
			}
		}
	}
	return nil
}

// verifyBalances compares every balance with the sum of its account's unique payments and
// returns the total.
//
// With -shards it checks every database: an account holds its payments on its own shard and 0
// on every other.
func (d *demo) verifyBalances(ctx context.Context) (int64, error) {
	var total int64
	var wrong []string
	for k, st := range d.dbs() {
		rows, err := st.db.QueryContext(ctx, "SELECT id, balance FROM "+d.accounts+" ORDER BY id")
		if err != nil {
			return 0, fmt.Errorf("read balances: %w", err)
		}
		type account struct{ ID, Balance int64 }
		got, err := collect(rows, func(r *sql.Rows) (a account, err error) { return a, r.Scan(&a.ID, &a.Balance) })
		if err != nil {
			return 0, fmt.Errorf("read balances: %w", err)
		}
		where := ""
		if d.o.sharded() {
			where = fmt.Sprintf("shard %d: ", k)
		}
		for _, a := range got {
			want, ok := d.w.expected[a.ID]
			if d.o.sharded() && shardOf(a.ID, d.o.shards) != k {
				want = 0 // another shard's account: no payment may reach it here
			}
			if !ok || a.Balance != want {
				wrong = append(wrong, fmt.Sprintf("%saccount %d: balance %d, want %d (diff %+d)", where, a.ID, a.Balance, want, a.Balance-want))
			}
			total += a.Balance
		}
		if len(got) != len(d.w.expected) {
			wrong = append(wrong, fmt.Sprintf("%s%d accounts in the table, want %d", where, len(got), len(d.w.expected)))
		}
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

// poisonRuns counts the rejection log: handler runs of poison payments.
type poisonRuns struct {
	total int64
	// perConsumer is indexed by consumer run number (1-based).
	perConsumer map[int]int64
}

// byConsumer reads, e.g., "consumer #3: 5, #4: 4".
func (r poisonRuns) byConsumer() string {
	var ns []int
	for n := range r.perConsumer {
		ns = append(ns, n)
	}
	sort.Ints(ns)
	parts := make([]string, len(ns))
	for i, n := range ns {
		parts[i] = fmt.Sprintf("#%d: %d", n, r.perConsumer[n])
	}
	return "consumer " + strings.Join(parts, ", ")
}

// verifyPoison checks each poison payment: on the dead-letter topic exactly once (read from the
// broker), with inbox_attempts = MaxAttempts; its attempts row says MaxAttempts and
// dead-lettered; the handler ran MaxAttempts times in all (the rejection log). Their balance,
// the frozen account's, is checked by verifyBalances. It returns the rejection log's counts.
func (d *demo) verifyPoison(ctx context.Context) (poisonRuns, error) {
	want := d.o.maxAttempts
	wantAttempts := strconv.Itoa(want)
	isPoison := make(map[string]bool, len(d.w.poisonIDs))
	for _, id := range d.w.poisonIDs {
		isPoison[id] = true
	}

	dls, err := d.broker.DeadLetters(ctx, len(d.w.poisonIDs))
	if err != nil {
		return poisonRuns{}, err
	}
	onTopic := make(map[string]int, len(dls))
	for _, dl := range dls {
		if !isPoison[dl.UUID] {
			return poisonRuns{}, fmt.Errorf("the dead-letter topic holds %s, which is not a poison payment", dl.UUID)
		}
		if dl.Attempts != wantAttempts {
			return poisonRuns{}, fmt.Errorf("dead letter %s says %s=%q, want %q", dl.UUID, inbox.DeadLetterAttemptsKey, dl.Attempts, wantAttempts)
		}
		onTopic[dl.UUID]++
	}

	type attemptsRow struct {
		ID           string
		Attempts     int
		DeadLettered bool
	}
	attemptsOf := make(map[string]attemptsRow, len(d.w.poisonIDs))
	for k, st := range d.dbs() {
		rows, err := st.db.QueryContext(ctx, st.q("SELECT message_id, attempts, dead_lettered_at IS NOT NULL FROM "+st.attemptsTable+
			" WHERE consumer_name = $1"), consumerName)
		if err != nil {
			return poisonRuns{}, fmt.Errorf("read attempts: %w", err)
		}
		attempts, err := collect(rows, func(r *sql.Rows) (a attemptsRow, err error) { return a, r.Scan(&a.ID, &a.Attempts, &a.DeadLettered) })
		if err != nil {
			return poisonRuns{}, fmt.Errorf("read attempts: %w", err)
		}
		for _, a := range attempts {
			if _, dup := attemptsOf[a.ID]; dup {
				return poisonRuns{}, fmt.Errorf("payment %s has attempts rows on two databases (the second on shard %d)", a.ID, k)
			}
			attemptsOf[a.ID] = a
		}
	}

	type rejection struct {
		ID  string
		Run int
	}
	rows, err := d.st.db.QueryContext(ctx, "SELECT message_id, consumer_run FROM "+d.rejections)
	if err != nil {
		return poisonRuns{}, fmt.Errorf("read the rejection log: %w", err)
	}
	rejections, err := collect(rows, func(r *sql.Rows) (j rejection, err error) { return j, r.Scan(&j.ID, &j.Run) })
	if err != nil {
		return poisonRuns{}, fmt.Errorf("read the rejection log: %w", err)
	}
	runs := poisonRuns{perConsumer: map[int]int64{}}
	runsOf := make(map[string]int, len(d.w.poisonIDs))
	for _, r := range rejections {
		runsOf[r.ID]++
		runs.perConsumer[r.Run]++
		runs.total++
	}

	for _, id := range d.w.poisonIDs {
		a := attemptsOf[id]
		switch {
		case onTopic[id] != 1:
			return runs, fmt.Errorf("poison payment %s is on the dead-letter topic %d times, want exactly once", id, onTopic[id])
		case a.Attempts != want || !a.DeadLettered:
			return runs, fmt.Errorf("poison payment %s: attempts row says %d attempts, dead-lettered %t; want %d, true", id, a.Attempts, a.DeadLettered, want)
		case runsOf[id] != want:
			return runs, fmt.Errorf("poison payment %s: the handler ran %d times, want %d", id, runsOf[id], want)
		}
	}
	if runs.total != int64(want*len(d.w.poisonIDs)) {
		return runs, fmt.Errorf("the rejection log has %d rows, want %d (a payment that is not poison was rejected)", runs.total, want*len(d.w.poisonIDs))
	}
	return runs, nil
}

// verifyReceipts checks the receipts counted downstream: one per unique payment, for its
// account and amount (their sum is the sum of the balances).
func (d *demo) verifyReceipts(ctx context.Context, unique, total int64) error {
	rows, err := d.st.db.QueryContext(ctx, "SELECT payment_id, amount_cents FROM "+d.receipts)
	if err != nil {
		return fmt.Errorf("read receipts: %w", err)
	}
	type counted struct {
		payment string
		amount  int64
	}
	got, err := collect(rows, func(r *sql.Rows) (c counted, err error) { return c, r.Scan(&c.payment, &c.amount) })
	if err != nil {
		return fmt.Errorf("read receipts: %w", err)
	}
	isPayment := make(map[string]bool, len(d.w.ids))
	for _, id := range d.w.ids {
		isPayment[id] = true
	}
	distinct := map[string]bool{}
	var sum int64
	for _, c := range got {
		distinct[c.payment] = true
		sum += c.amount
	}
	n, payments, published := int64(len(got)), int64(len(distinct)), int64(0)
	for id := range distinct {
		if isPayment[id] {
			published++
		}
	}
	if n != unique || payments != unique || published != unique || sum != total {
		return fmt.Errorf("receipts: %d counted for %d payments (%d of them published unique payments), %d cents; want %d receipts, one per unique payment, %d cents",
			n, payments, published, sum, unique, total)
	}
	return nil
}

// cleanup deletes the run's queues and streams and its schema, after a successful run.
func (d *demo) cleanup() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.broker.Cleanup(ctx); err != nil {
		return fmt.Errorf("cleanup: %w", err)
	}
	if err := d.st.drop(ctx); err != nil {
		return fmt.Errorf("cleanup: %w", err)
	}
	if err := d.dropShards(ctx); err != nil {
		return fmt.Errorf("cleanup: %w", err)
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
