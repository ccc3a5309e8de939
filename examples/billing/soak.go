package main

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
)

// Soak bounds: a consumer is SIGKILLed after a random time in [soakMinLife, soakMaxLife).
const (
	soakMinLife = 5 * time.Second
	soakMaxLife = 20 * time.Second
)

// noPublisher lets the orchestrator build an outbox.Relay only to read its Lag; it never runs.
type noPublisher struct{}

func (noPublisher) Publish(string, ...*message.Message) error {
	return errors.New("the lag probe publishes nothing")
}
func (noPublisher) Close() error { return nil }

// soakSample is the orchestrator's pause between two samples of the relay's backlog.
const soakSample = 250 * time.Millisecond

// soak is -soak: instead of the scripted crashes, consumers are SIGKILLed by the orchestrator
// every 5 to 20 s (random) until every unique payment is processed, while the relay's backlog
// (outbox rows not yet relayed, outbox.Relay.Lag) is sampled every 250 ms. Then the poison
// payments are published, a last consumer runs to completion and stops gracefully, and the
// run is verified like the demo: inbox rows, every balance, the dead letters, every receipt
// exactly once downstream.
//
// It reports the relay's largest backlog (and the longest pause between two samples), the
// SIGKILLs, and the recovery time of each: from the SIGKILL to the first billing delivery the
// next consumer settled (its SETTLED line), which includes that process's start, its broker
// connection and the broker's redelivery of what the killed one held. A consumer SIGKILLed
// before it settled anything extends the recovery of the kill before it (one sample, counted
// as unrecovered kills). Finally it fails when the graceful stop of the last consumer logged a
// line at ERROR level.
func (d *demo) soak(ctx context.Context, start time.Time, rng *mrand.Rand) error {
	probe, err := outbox.NewRelay(outbox.RelayConfig{Config: outboxConfig(d.schema), Pool: d.pool, Publisher: noPublisher{}}, nil)
	if err != nil {
		return err
	}
	s := &soakState{d: d, probe: probe, lastSample: time.Now()}
	consumeStart := time.Now()
	for done := false; !done; {
		if done, err = s.killCycle(ctx, rng); err != nil {
			return err
		}
	}
	soakTime := time.Since(consumeStart)

	if err := d.soakLastConsumer(ctx, s); err != nil {
		return err
	}
	if err := d.verifySoak(ctx); err != nil {
		return err
	}
	s.printSummary(soakTime, start)
	return nil
}

// soakState is what -soak measures while it kills consumers.
type soakState struct {
	d     *demo
	probe *outbox.Relay

	kills, samples, unrecoveredKills int
	maxBacklog, maxVisible           int64
	maxAge, maxGap, maxHold          time.Duration
	maxHolder                        string
	recoveries                       []time.Duration
	// killedAt: the earliest SIGKILL no consumer has settled a delivery after yet.
	killedAt   time.Time
	lastSample time.Time
}

// sample reads the relay's backlog and the cluster's horizon once and keeps their maxima.
func (s *soakState) sample(ctx context.Context) {
	if lag, err := s.probe.Lag(ctx); err == nil {
		s.maxBacklog = max(s.maxBacklog, lag.Pending)
		s.maxAge = max(s.maxAge, lag.OldestAge)
		s.samples++
		s.maxGap = max(s.maxGap, time.Since(s.lastSample))
		s.lastSample = time.Now()
	}
	if h, err := s.d.horizon(ctx); err == nil {
		s.maxVisible = max(s.maxVisible, h.visible)
		if h.oldestXact > s.maxHold {
			s.maxHold, s.maxHolder = h.oldestXact, h.holder
		}
	}
}

// recovered reads c's SETTLED line, once, and records the recovery from killedAt.
func (s *soakState) recovered(c *child) {
	if s.killedAt.IsZero() {
		return
	}
	r, ok := c.report(lineSettled)
	if !ok {
		return
	}
	at := time.Unix(0, r.SettledAt)
	rec := at.Sub(s.killedAt)
	s.recoveries = append(s.recoveries, rec)
	fmt.Fprintf(s.d.out, "soak        consumer #%d settled its first delivery %.2fs after the last SIGKILL\n", c.n, rec.Seconds())
	s.killedAt = time.Time{}
}

// killCycle starts a consumer, samples every soakSample until a random moment in
// [soakMinLife, soakMaxLife) or until every unique payment is processed, then SIGKILLs it and
// prints the state. done reports that every unique payment was processed.
func (s *soakState) killCycle(ctx context.Context, rng *mrand.Rand) (done bool, err error) {
	d := s.d
	unique := int64(len(d.w.ids))
	c, err := d.startConsumer(crashPoint{})
	if err != nil {
		return false, err
	}
	started := time.Now()
	killAt := started.Add(soakMinLife + time.Duration(rng.Int64N(int64(soakMaxLife-soakMinLife))))
	for time.Now().Before(killAt) {
		if c.exited() {
			return false, d.childFailure(c, fmt.Errorf("consumer #%d exited by itself: %s", c.n, c.describeExit()))
		}
		s.sample(ctx)
		s.recovered(c)
		rows, err := d.inboxRows(ctx)
		if err != nil {
			return false, d.childFailure(c, err)
		}
		if rows == unique {
			done = true
			break
		}
		if err := sleep(ctx, soakSample); err != nil {
			return false, d.childFailure(c, err)
		}
	}
	s.recovered(c)
	if !s.killedAt.IsZero() {
		s.unrecoveredKills++ // c settled nothing: the previous kill's recovery goes on
	}
	at := time.Now()
	c.killAndWait()
	if !c.killedBySIGKILL() {
		return false, d.childFailure(c, fmt.Errorf("consumer #%d was not killed by SIGKILL: %s", c.n, c.describeExit()))
	}
	if s.killedAt.IsZero() {
		s.killedAt = at
	}
	s.kills++
	s.printKill(ctx, c, at.Sub(started))
	return done, nil
}

// printKill prints the state after consumer c was SIGKILLed after living for lived.
func (s *soakState) printKill(ctx context.Context, c *child, lived time.Duration) {
	d := s.d
	rows, _ := d.inboxRows(ctx)
	var backlog int64
	if lag, err := s.probe.Lag(ctx); err == nil {
		backlog = lag.Pending
	}
	h, _ := d.horizon(ctx)
	holder := ""
	if h.oldestXact > time.Second {
		holder = " (" + h.holder + ")"
	}
	fmt.Fprintf(d.out, "soak        consumer #%d SIGKILLed after %.1fs; inbox rows %d/%d; relay backlog now %d rows (%d visible to the relay), so far at most %d (%d visible; oldest %.1fs); oldest transaction in the cluster %.1fs%s\n",
		c.n, lived.Seconds(), rows, len(d.w.ids), backlog, h.visible, s.maxBacklog, s.maxVisible, s.maxAge.Seconds(), h.oldestXact.Seconds(), holder)
}

// soakLastConsumer publishes the poison payments and runs a last consumer to completion; it
// fails when a consumer reported a data race or the last one's graceful stop logged a line at
// ERROR level.
func (d *demo) soakLastConsumer(ctx context.Context, s *soakState) error {
	if err := d.broker.Publish(d.w.poison); err != nil {
		return err
	}
	c, _, err := d.runToCompletion(ctx)
	if err != nil {
		return err
	}
	s.recovered(c)
	if r, ok := c.report(lineStats); ok {
		fmt.Fprintf(d.out, "last        consumer #%d stopped with SIGTERM once everything was processed, dead-lettered and relayed (processed %d, duplicates skipped %d, dead-lettered %d)\n",
			c.n, r.Processed, r.Duplicates, r.DeadLettered)
	}
	if err := d.checkRaces(); err != nil {
		return err
	}
	// The consumer logs through slog's TextHandler: "level=ERROR".
	stopLog := c.stopLog()
	if n := strings.Count(stopLog, "level=ERROR"); n > 0 {
		fmt.Fprintf(os.Stderr, "--- consumer #%d's log after SIGTERM ---\n%s---\n", c.n, stopLog)
		return fmt.Errorf("the graceful stop of consumer #%d logged %d lines at ERROR level", c.n, n)
	}
	fmt.Fprintf(d.out, "stop        consumer #%d's graceful stop logged no ERROR line (%d WARN)\n", c.n, strings.Count(stopLog, "level=WARN"))
	return nil
}

// verifySoak checks the soak's end state like the demo: inbox rows, every balance, the dead
// letters, every receipt exactly once downstream; it prints one line.
func (d *demo) verifySoak(ctx context.Context) error {
	unique := int64(len(d.w.ids))
	if err := d.verifyInbox(ctx, unique); err != nil {
		return err
	}
	total, err := d.verifyBalances(ctx)
	if err != nil {
		return err
	}
	if _, err := d.verifyPoison(ctx); err != nil {
		return err
	}
	if err := d.verifyReceipts(ctx, unique, total); err != nil {
		return err
	}
	pending, err := d.broker.Pending(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(d.out, "verified    %d unique payments (%d deliveries, %d of them re-sent duplicates), every balance (%d cents), %d dead letters, %d receipts once each; broker %d left (%s)\n",
		unique, len(d.w.deliveries), d.w.duplicates, total, len(d.w.poisonIDs), unique, pending, d.broker.pendingMeaning)
	return nil
}

// printSummary prints the soak's figures: SIGKILLs, the relay's backlog, the horizon and the
// recoveries. soakTime is the time the consumers were killed over.
func (s *soakState) printSummary(soakTime time.Duration, start time.Time) {
	d := s.d
	fmt.Fprintf(d.out, "soak        %d SIGKILLs in %.1fs (%.0f unique payments/s while killing); relay backlog never above %d rows (%d samples, at most %.2fs apart), oldest pending receipt %.1fs; %.1fs in total\n",
		s.kills, soakTime.Seconds(), float64(len(d.w.ids))/soakTime.Seconds(), s.maxBacklog, s.samples, s.maxGap.Seconds(), s.maxAge.Seconds(), time.Since(start).Seconds())
	fmt.Fprintf(d.out, "horizon     of that backlog, at most %d rows were visible to the relay (below the cluster's oldest running transaction); the oldest transaction seen in the cluster was %.1fs old (%s)\n",
		s.maxVisible, s.maxHold.Seconds(), s.maxHolder)
	if len(s.recoveries) > 0 {
		slices.Sort(s.recoveries)
		fmt.Fprintf(d.out, "recovery    SIGKILL to the next consumer's first settled delivery: min %.2fs, median %.2fs, max %.2fs (%d samples; %d consumers killed before settling one)\n",
			s.recoveries[0].Seconds(), s.recoveries[len(s.recoveries)/2].Seconds(), s.recoveries[len(s.recoveries)-1].Seconds(), len(s.recoveries), s.unrecoveredKills)
	}
}

// horizonSample is what holds the relay back, read by horizon.
type horizonSample struct {
	// visible: pending outbox rows the relay can read now. Its REPEATABLE READ snapshot sees
	// a row only when the row's transaction ID is below pg_snapshot_xmin, the oldest
	// transaction still running anywhere in the cluster (watermill-sql's PostgreSQL schema);
	// the rest of the backlog waits for that transaction, however fast the relay is.
	visible int64
	// oldestXact: the age of the oldest transaction in the cluster that holds a transaction
	// ID (pg_stat_activity.backend_xid), this run's or any other session's; holder says whose
	// (its pid and application_name).
	oldestXact time.Duration
	holder     string
}

// horizon reads how much of the relay's backlog the cluster's oldest transaction hides.
func (d *demo) horizon(ctx context.Context) (horizonSample, error) {
	cfg := outboxConfig(d.schema)
	msgs, offs := cfg.MessagesTable(), cfg.OffsetsTable()
	var h horizonSample
	var age float64
	err := d.pool.QueryRow(ctx, `WITH g AS (
		SELECT coalesce((SELECT offset_acked FROM `+offs+` WHERE consumer_group = ''), 0) AS offset_acked,
		       coalesce((SELECT last_processed_transaction_id FROM `+offs+` WHERE consumer_group = ''), '0'::xid8) AS tx
	)
	SELECT (SELECT count(*) FROM `+msgs+` m, g
	        WHERE ((m.transaction_id = g.tx AND m."offset" > g.offset_acked) OR m.transaction_id > g.tx)
	          AND m.transaction_id < pg_snapshot_xmin(pg_current_snapshot())),
	       coalesce(o.age, 0)::float8, coalesce(o.holder, '')
	FROM (SELECT 1) one LEFT JOIN (
		SELECT extract(epoch FROM clock_timestamp() - xact_start) AS age,
		       format('pid %s, application_name %L', pid, application_name) AS holder
		FROM pg_stat_activity WHERE backend_xid IS NOT NULL ORDER BY xact_start LIMIT 1
	) o ON true`).Scan(&h.visible, &age, &h.holder)
	if err != nil {
		return h, fmt.Errorf("read the relay's horizon: %w", err)
	}
	h.oldestXact = time.Duration(age * float64(time.Second))
	return h, nil
}
