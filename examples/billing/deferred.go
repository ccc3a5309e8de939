//go:build unix

package main

// The demo in the store-then-process mode (-mode=store-then-process): the consumer's receipt
// (package middleware/deferred) stores each payment delivery as a pending row, commits and
// acks it; the consumer's workers run the same billing handler later, each row in its own
// transaction that marks it done. The payments carry their account as the aggregate key and a
// per-account sequence number (workload.go), so the workers apply each account's payments one at
// a time, in that order, whatever order the broker delivers them in.
//
// The orchestrator runs the consumer three times:
//
//  1. the consumer SIGKILLs itself right after a receipt committed, once -messages/4 rows are
//     stored, before the router acked that delivery (a receiver killed between commit and ack);
//  2. the consumer SIGKILLs itself inside the billing handler of a worker, after it applied
//     its share of the payments, with that row's transaction open and the rest of the worker's
//     claimed batch in processing (a worker killed mid-batch: the reaper returns those rows
//     after the lease, and fencing keeps the dead worker from committing them);
//  3. after -poison payments to the frozen account are published, the consumer runs until
//     every payment row is done, every poison row is dead, every receipt is counted and the
//     broker has nothing left, then is stopped with SIGTERM.
//
// Then the orchestrator checks the balances (the sum of each account's unique payments), the
// table (one row per published ID: done for payments, dead after exactly -max-attempts handler
// runs for poison payments, each dead-lettered once on the broker), the receipts (one per
// payment), and the order: the handler records each account's sequence numbers in the order it
// applied them, and they must be 1, 2, ... n for every account.

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

const (
	// deferredLease is the workers' lease (deferred.Config.Lease): a row left in processing
	// by a killed worker returns to pending this long after its claim. Short for the demo;
	// it must exceed the longest handler run.
	deferredLease = 3 * time.Second
	// appliedTable records each payment the billing handler applied: account, sequence number,
	// in the handler's transaction (the ordering check).
	appliedTable = "applied"
)

// deferredConfig is the billing consumer's store-then-process configuration; the orchestrator
// uses it (with a nil pool replaced) to migrate the table and to name it.
func deferredConfig(o options, schema string) deferred.Config {
	return deferred.Config{
		Schema:       schema,
		ConsumerName: consumerName,
		AggregateKey: deferred.MetadataAggregateKey(aggregateKeyField),
		Ordering:     deferred.OrderProducerSequence,
		// A dead poison payment must not hold the frozen account's later payments: they are
		// poison too, and each must reach its own -max-attempts.
		AfterDead:     deferred.ContinueAggregate,
		SequenceField: sequenceField,
		Workers:       concurrency,
		PollInterval:  200 * time.Millisecond,
		Lease:         deferredLease,
		Backoff:       50 * time.Millisecond,
		MaxBackoff:    500 * time.Millisecond,
		MaxAttempts:   o.maxAttempts,
		// claimed_by names the consumer process, so the orchestrator finds its claims.
		WorkerName: o.appName,
	}
}

// addDeferredBilling subscribes the store-then-process receipt of the billing consumer and
// registers its workers running h (router.AddModeHandler): the receipts h returns go through
// the outbox in each row's transaction.
func addDeferredBilling(r *router.Router, o options, store *pgstore.Store, ob *outbox.Outbox, h billingHandler, crash *crashPoints, logger watermill.LoggerAdapter) (*deferred.Inbox, error) {
	h.applied = qualified(o.schema, appliedTable)
	h.onApplied = crash.onApplied
	ib, _, err := r.AddModeHandler(inbox.Config{
		Store:               store,
		ConsumerName:        consumerName,
		DeadLetterPublisher: r.Broker.Publisher,
		DeadLetterTopic:     o.deadLetterTopic,
		MaxAttempts:         o.maxAttempts,
		Outbox:              ob,
	}, deferredConfig(o, o.schema), o.topic, o.receiptsTopic, h.handle, logger)
	if err != nil {
		return nil, err
	}
	dib, ok := ib.(*deferred.Inbox)
	if !ok {
		return nil, fmt.Errorf("router mode %q: AddModeHandler returned %T, want a store-then-process inbox", r.Mode(), ib)
	}
	return dib, nil
}

// setupDeferred migrates the store-then-process table and creates the applied table.
func (d *demo) setupDeferred(ctx context.Context) error {
	cfg := deferredConfig(d.o, d.schema)
	cfg.Pool = d.pool
	ib, err := deferred.New(cfg, nil)
	if err != nil {
		return err
	}
	if _, err := ib.Migrate(ctx); err != nil {
		return err
	}
	d.deferredTable = ib.Table()
	_, err = d.pool.Exec(ctx, "CREATE TABLE "+qualified(d.schema, appliedTable)+
		" (id bigserial PRIMARY KEY, account_id bigint NOT NULL, seq bigint NOT NULL, message_id text NOT NULL)")
	if err != nil {
		return fmt.Errorf("create tables: %w", err)
	}
	return nil
}

// deferredCounts are the billing consumer's rows in the store-then-process table, by status.
type deferredCounts struct {
	rows, pending, processing, done, dead int64
}

func (d *demo) deferredCounts(ctx context.Context) (deferredCounts, error) {
	var c deferredCounts
	err := d.pool.QueryRow(ctx, `SELECT count(*),
			count(*) FILTER (WHERE status = 'pending'), count(*) FILTER (WHERE status = 'processing'),
			count(*) FILTER (WHERE status = 'done'), count(*) FILTER (WHERE status = 'dead')
		FROM `+d.deferredTable+` WHERE consumer_name = $1`, consumerName).Scan(&c.rows, &c.pending, &c.processing, &c.done, &c.dead)
	if err != nil {
		return c, fmt.Errorf("count rows: %w", err)
	}
	return c, nil
}

// runDeferred is run's sequel in the store-then-process mode, once the payments are published.
func (d *demo) runDeferred(ctx context.Context, start time.Time) error {
	consumeStart := time.Now()

	// 1. A receiver killed between its commit and its ack.
	r1, n1, err := d.crashDeferredReceiver(ctx)
	if err != nil {
		return err
	}

	// 2. A worker killed mid-batch, inside the handler, its row's transaction open.
	if err := d.crashDeferredWorker(ctx, n1); err != nil {
		return err
	}

	// 3. Poison payments, then run to the end.
	r3, completeAt, pendingAfter, err := d.lastDeferredConsumer(ctx)
	if err != nil {
		return err
	}
	consumeTime := completeAt.Sub(consumeStart)

	if err := d.verifyDeferred(ctx, r1.ReceiptsDuplicates+r3.ReceiptsDuplicates); err != nil {
		return err
	}
	fmt.Fprintf(d.out, "duplicates  %d deliveries found already stored by the receipt, counted by consumers #1 and #3 (published duplicates and crash redeliveries; consumer #2's counters died with it)\n",
		r1.Deferred.Duplicates+r3.Deferred.Duplicates)
	fmt.Fprintf(d.out, "broker      %d left after the stop (%s)\n", pendingAfter, d.broker.pendingMeaning)
	fmt.Fprintf(d.out, "restarts    2 (consumer started 3 times; 2 crashes: a receiver after commit before ack, a worker mid-batch inside its handler)\n")
	d.printElapsed(start, consumeTime)
	return nil
}

// crashDeferredReceiver runs consumer #1 until it SIGKILLs itself right after a receipt
// committed, once -messages/4 rows are stored, before the router acked that delivery. It
// returns its CRASH report and the table's counts after its death.
func (d *demo) crashDeferredReceiver(ctx context.Context) (consumerReport, deferredCounts, error) {
	unique := int64(len(d.w.ids))
	k := max(1, len(d.w.ids)/4)
	c1, err := d.startConsumer(crashPoint{afterCommits: k})
	if err != nil {
		return consumerReport{}, deferredCounts{}, err
	}
	if err := c1.wait(ctx); err != nil {
		return consumerReport{}, deferredCounts{}, d.childFailure(c1, err)
	}
	if !c1.killedBySIGKILL() {
		return consumerReport{}, deferredCounts{}, d.childFailure(c1, fmt.Errorf("consumer #1 should have SIGKILLed itself after its %s receipt, but it exited: %s", ordinal(k), c1.describeExit()))
	}
	r1, ok := c1.report(lineCrash)
	if !ok || r1.Deferred == nil {
		return consumerReport{}, deferredCounts{}, d.childFailure(c1, errors.New("consumer #1 died without its CRASH report"))
	}
	n1, err := d.deferredCounts(ctx)
	if err != nil {
		return consumerReport{}, deferredCounts{}, err
	}
	if n1.rows < int64(k) || n1.rows >= unique {
		return consumerReport{}, deferredCounts{}, fmt.Errorf("after consumer #1: %d rows stored, want at least %d and fewer than %d", n1.rows, k, unique)
	}
	fmt.Fprintf(d.out, "consumer #1 SIGKILLed itself right after a receipt committed, once %d payments were stored, before the router acked it (received %d, duplicates %d, done by its workers %d); rows %d/%d (done %d)\n",
		k, r1.Deferred.Received, r1.Deferred.Duplicates, r1.Deferred.Done, n1.rows, unique, n1.done)
	return r1, n1, nil
}

// crashDeferredWorker runs consumer #2 until it SIGKILLs itself inside a worker's billing
// handler, after it applied a third of the payments not done in n1, and checks that the row it
// died in is still claimed by it (its transaction never committed).
func (d *demo) crashDeferredWorker(ctx context.Context, n1 deferredCounts) error {
	unique := int64(len(d.w.ids))
	m := max(1, int(unique-n1.done)/3)
	c2, err := d.startConsumer(crashPoint{afterApplied: m})
	if err != nil {
		return err
	}
	if err := c2.wait(ctx); err != nil {
		return d.childFailure(c2, err)
	}
	if !c2.killedBySIGKILL() {
		return d.childFailure(c2, fmt.Errorf("consumer #2 should have SIGKILLed itself in a worker's handler after %d payments, but it exited: %s", m, c2.describeExit()))
	}
	r2, ok := c2.report(lineCrash)
	if !ok || r2.Applied == "" || r2.Deferred == nil {
		return d.childFailure(c2, errors.New("consumer #2 died without its CRASH report"))
	}
	var killedStatus string
	var killedAttempts, claimedByDead int64
	err = d.pool.QueryRow(ctx, `SELECT status, attempts,
			(SELECT count(*) FROM `+d.deferredTable+` WHERE consumer_name = $1 AND status = 'processing' AND claimed_by LIKE $3 || '/%')
		FROM `+d.deferredTable+` WHERE consumer_name = $1 AND message_id = $2`,
		consumerName, r2.Applied, d.consumerAppName(c2.n)).Scan(&killedStatus, &killedAttempts, &claimedByDead)
	if err != nil {
		return fmt.Errorf("read the row consumer #2 died in: %w", err)
	}
	// The killed transaction never committed: its row is still claimed by the dead worker.
	if killedStatus != string(deferred.StatusProcessing) || claimedByDead < 1 {
		return fmt.Errorf("payment %s, whose handler consumer #2 died in: status %s, and %d rows in processing claimed by it; want processing and at least 1",
			r2.Applied, killedStatus, claimedByDead)
	}
	n2, err := d.deferredCounts(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(d.out, "consumer #2 SIGKILLed itself in a worker's handler after applying %d payments, transaction open (payment %s: still processing, attempt %d); %d rows of its claimed batches left in processing; rows %d/%d (done %d)\n",
		m, r2.Applied, killedAttempts, claimedByDead, n2.rows, unique, n2.done)
	return nil
}

// lastDeferredConsumer publishes the poison payments, runs consumer #3 to the end and stops it
// gracefully. It returns its STATS report, the time the work was found complete and what the
// broker holds after the stop.
func (d *demo) lastDeferredConsumer(ctx context.Context) (consumerReport, time.Time, int64, error) {
	w := d.w
	if err := d.broker.Publish(w.poison); err != nil {
		return consumerReport{}, time.Time{}, 0, err
	}
	fmt.Fprintf(d.out, "published   %d payments to frozen account %d: poison messages, which the handler rejects on every attempt with an ordinary error\n",
		len(w.poison), w.frozenAccount)
	c3, completeAt, err := d.runDeferredToCompletion(ctx)
	if err != nil {
		return consumerReport{}, time.Time{}, 0, err
	}
	r3, ok := c3.report(lineStats)
	if !ok || r3.Deferred == nil {
		return consumerReport{}, time.Time{}, 0, d.childFailure(c3, errors.New("consumer #3 exited without its STATS report"))
	}
	fmt.Fprintf(d.out, "consumer #3 stopped with SIGTERM once every payment row was done, every poison row dead, every receipt counted and the broker drained (received %d, duplicates %d, done %d, failed %d, dead %d, reaped %d, fenced %d)\n",
		r3.Deferred.Received, r3.Deferred.Duplicates, r3.Deferred.Done, r3.Deferred.Failed, r3.Deferred.Dead, r3.Deferred.Reaped, r3.Deferred.Fenced)
	pendingAfter, err := d.broker.Pending(ctx)
	if err != nil {
		return consumerReport{}, time.Time{}, 0, err
	}
	return r3, completeAt, pendingAfter, nil
}

// verifyDeferred checks the store-then-process mode's end state and prints each check: no
// consumer reported a data race, the table's rows, every balance, the poison payments, the
// order of each account's payments and the receipts. receiptsDuplicates is what the receipts
// inbox skipped, as the consumers that lived to report it counted.
func (d *demo) verifyDeferred(ctx context.Context, receiptsDuplicates uint64) error {
	w := d.w
	unique := int64(len(w.ids))
	poison := int64(len(w.poisonIDs))
	if err := d.checkRaces(); err != nil {
		return err
	}
	if err := d.verifyDeferredRows(ctx, unique, poison); err != nil {
		return err
	}
	fmt.Fprintf(d.out, "rows        %d = %d unique payments done + %d poison dead, each published ID exactly once\n", unique+poison, unique, poison)
	total, err := d.verifyBalances(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(d.out, "balances    verified: %d/%d accounts equal the sum of their unique payments (%d cents in total); frozen account %d: 0\n",
		d.o.accounts, d.o.accounts, total, w.frozenAccount)
	runs, err := d.verifyDeferredPoison(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(d.out, "poison      dead %d/%d after %d attempts each: rows in status dead at %d attempts, each dead-lettered once on topic %s; handler ran %d times, %d per payment (%s); no balance changed\n",
		len(w.poisonIDs), len(w.poisonIDs), d.o.maxAttempts, d.o.maxAttempts, d.topics.deadLetters, runs.total, d.o.maxAttempts, runs.byConsumer())
	if err := d.verifyOrder(ctx); err != nil {
		return err
	}
	fmt.Fprintf(d.out, "ordering    verified: each of the %d accounts' payments applied once each, in sequence order 1..n (aggregate key = account, producer sequence in metadata %s)\n",
		d.o.accounts, sequenceField)
	if err := d.verifyReceipts(ctx, unique, total); err != nil {
		return err
	}
	fmt.Fprintf(d.out, "receipts    counted %d = %d unique payments, one each, by the receipts inbox; it skipped %d duplicates\n",
		unique, unique, receiptsDuplicates)
	return nil
}

// runDeferredToCompletion starts a consumer, waits until every payment row is done, every
// poison row dead, every receipt counted and the broker empty, all for drainedFor, and stops
// it with SIGTERM.
func (d *demo) runDeferredToCompletion(ctx context.Context) (*child, time.Time, error) {
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
		n, err := d.deferredCounts(ctx)
		var receipts, pending int64
		if err == nil {
			err = d.pool.QueryRow(ctx, "SELECT count(*) FROM "+d.receipts).Scan(&receipts)
		}
		if err == nil {
			pending, err = d.broker.Pending(ctx)
		}
		if err != nil {
			return nil, time.Time{}, d.childFailure(c, fmt.Errorf("waiting for consumer #%d: %w", c.n, err))
		}
		switch {
		case receipts > unique:
			return nil, time.Time{}, d.childFailure(c, fmt.Errorf("%d receipts counted for %d unique payments", receipts, unique))
		case n.dead > poison:
			return nil, time.Time{}, d.childFailure(c, fmt.Errorf("%d rows dead, but only %d payments are poison", n.dead, poison))
		}
		switch {
		case n.rows != unique+poison || n.done != unique || n.dead != poison || receipts != unique || pending != 0:
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
				return nil, time.Time{}, d.childFailure(c, fmt.Errorf("consumer #%d failed to stop gracefully: %s", c.n, c.describeExit()))
			}
			return c, completeSince, nil
		}
		if err := sleep(ctx, pollEvery); err != nil {
			return nil, time.Time{}, d.childFailure(c, fmt.Errorf("waiting for consumer #%d (rows %d, done %d, dead %d, processing %d, receipts %d, %d pending on the broker; want %d, %d, %d, 0, %d, 0): %w",
				c.n, n.rows, n.done, n.dead, n.processing, receipts, pending, unique+poison, unique, poison, unique, err))
		}
	}
}

// verifyDeferredRows checks the table: one row per published ID, payments done, poison dead.
func (d *demo) verifyDeferredRows(ctx context.Context, unique, poison int64) error {
	var rows, done, dead int64
	err := d.pool.QueryRow(ctx, `SELECT count(*),
			count(*) FILTER (WHERE message_id = ANY($2::text[]) AND status = 'done'),
			count(*) FILTER (WHERE message_id = ANY($3::text[]) AND status = 'dead')
		FROM `+d.deferredTable+` WHERE consumer_name = $1`, consumerName, d.w.ids, d.w.poisonIDs).Scan(&rows, &done, &dead)
	if err != nil {
		return fmt.Errorf("verify rows: %w", err)
	}
	if rows != unique+poison || done != unique || dead != poison {
		return fmt.Errorf("table has %d rows, %d published payments done, %d poison payments dead; want %d, %d, %d", rows, done, dead, unique+poison, unique, poison)
	}
	return nil
}

// verifyDeferredPoison checks each poison payment: its row dead at -max-attempts attempts, on
// the dead-letter topic exactly once with inbox_attempts = -max-attempts, and -max-attempts
// handler runs in the rejection log.
func (d *demo) verifyDeferredPoison(ctx context.Context) (poisonRuns, error) {
	want := d.o.maxAttempts
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
		if dl.Attempts != strconv.Itoa(want) {
			return poisonRuns{}, fmt.Errorf("dead letter %s says %s=%q, want %d", dl.UUID, inbox.DeadLetterAttemptsKey, dl.Attempts, want)
		}
		onTopic[dl.UUID]++
	}
	type row struct {
		ID       string
		Status   string
		Attempts int
	}
	rows, err := d.pool.Query(ctx, "SELECT message_id, status, attempts FROM "+d.deferredTable+
		" WHERE consumer_name = $1 AND message_id = ANY($2::text[])", consumerName, d.w.poisonIDs)
	if err != nil {
		return poisonRuns{}, fmt.Errorf("read poison rows: %w", err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		return poisonRuns{}, fmt.Errorf("read poison rows: %w", err)
	}
	rowOf := make(map[string]row, len(got))
	for _, r := range got {
		rowOf[r.ID] = r
	}
	type rejection struct {
		ID  string
		Run int
	}
	rows, err = d.pool.Query(ctx, "SELECT message_id, consumer_run FROM "+d.rejections)
	if err != nil {
		return poisonRuns{}, fmt.Errorf("read the rejection log: %w", err)
	}
	rejections, err := pgx.CollectRows(rows, pgx.RowToStructByPos[rejection])
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
		r := rowOf[id]
		switch {
		case onTopic[id] != 1:
			return runs, fmt.Errorf("poison payment %s is on the dead-letter topic %d times, want exactly once", id, onTopic[id])
		case r.Status != string(deferred.StatusDead) || r.Attempts != want:
			return runs, fmt.Errorf("poison payment %s: row status %q at %d attempts; want dead at %d", id, r.Status, r.Attempts, want)
		case runsOf[id] != want:
			return runs, fmt.Errorf("poison payment %s: the handler ran %d times, want %d", id, runsOf[id], want)
		}
	}
	if runs.total != int64(want*len(d.w.poisonIDs)) {
		return runs, fmt.Errorf("the rejection log has %d rows, want %d (a payment that is not poison was rejected)", runs.total, want*len(d.w.poisonIDs))
	}
	return runs, nil
}

// verifyOrder checks the applied table, written by the handler in each row's transaction (so
// only committed runs are in it): every account's sequence numbers, in the order they were
// applied, are exactly 1, 2, ... n, where n is its number of unique payments, and each
// sequence number belongs to the payment the producer gave it.
func (d *demo) verifyOrder(ctx context.Context) error {
	type appliedRow struct {
		Account int64
		Seq     int64
		ID      string
	}
	rows, err := d.pool.Query(ctx, "SELECT account_id, seq, message_id FROM "+qualified(d.schema, appliedTable)+" ORDER BY id")
	if err != nil {
		return fmt.Errorf("read the applied payments: %w", err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[appliedRow])
	if err != nil {
		return fmt.Errorf("read the applied payments: %w", err)
	}
	wantID := make(map[[2]int64]string, len(d.w.ids))
	count := map[int64]int64{}
	for i, id := range d.w.ids {
		wantID[[2]int64{d.w.accountOf[i], d.w.seq[i]}] = id
		count[d.w.accountOf[i]]++
	}
	last := map[int64]int64{}
	var wrong []string
	for _, r := range got {
		if r.Seq != last[r.Account]+1 {
			wrong = append(wrong, fmt.Sprintf("account %d: sequence %d applied after %d", r.Account, r.Seq, last[r.Account]))
		}
		if wantID[[2]int64{r.Account, r.Seq}] != r.ID {
			wrong = append(wrong, fmt.Sprintf("account %d: sequence %d carried by payment %s, not the producer's", r.Account, r.Seq, r.ID))
		}
		last[r.Account] = r.Seq
	}
	for a, n := range count {
		if last[a] != n {
			wrong = append(wrong, fmt.Sprintf("account %d: %d of its %d payments applied in order", a, last[a], n))
		}
	}
	if len(got) != len(d.w.ids) {
		wrong = append(wrong, fmt.Sprintf("%d payments applied, want %d", len(got), len(d.w.ids)))
	}
	if len(wrong) > 0 {
		sort.Strings(wrong)
		n := len(wrong)
		if n > 5 {
			wrong = append(wrong[:5], "...")
		}
		return fmt.Errorf("ordering: %d problems: %s", n, strings.Join(wrong, "; "))
	}
	return nil
}
