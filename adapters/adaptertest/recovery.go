package adaptertest

import (
	"fmt"
	"syscall"
	"testing"
	"time"
)

// RecoveryTimes is what MeasureRecovery measured after the SIGKILL of a consumer process.
type RecoveryTimes struct {
	// Broker is the broker's name (adapters.Broker.Name).
	Broker string
	// First is the time from the kill to the successor's first committed payment.
	First time.Duration
	// All is the time from the kill to the last of the 400 payments committed.
	All time.Duration
	// Before is how many payments the killed process had committed (20 or a few more).
	Before int64
}

// MeasureRecovery measures how long a consumer group stands still after a consumer process is
// killed: it publishes 400 payments, starts a child consumer (one handler, the broker's
// defaults as h builds them), SIGKILLs it once it has committed 20, starts a successor at once,
// and returns the time from the kill to the successor's first committed payment (a new inbox
// row) and to the last one. It then checks every payment was applied exactly once (the sum of
// the balances is 400), and fails tb otherwise or when 2 minutes after the kill some payment
// is still unprocessed. It logs the figures as
// "RECOVERY broker=<name> first=<duration> all=<duration>".
//
// The time includes the successor's start (a fresh process connecting to PostgreSQL and the
// broker), which is what an orchestrator restarting a killed pod pays as well. It takes
// several seconds (more with long redelivery timeouts): run it from a benchmark, through
// BenchmarkRecovery, not from every go test run.
func MeasureRecovery(tb testing.TB, h Harness) RecoveryTimes {
	tb.Helper()
	if h.Timeout == 0 {
		h.Timeout = 30 * time.Second
	}
	if h.ChildTest == "" {
		h.ChildTest = "TestAdapterChild"
	}
	f := newFixture(tb, h)
	const n = 400
	for i := range n {
		f.publish(paymentMsg(fmt.Sprintf("rec-%d", i), i%5+1, 1, false))
	}
	name := f.broker.Name
	_ = f.broker.Close() // the parent only publishes; the children consume

	processed := func() int64 { return f.count("SELECT count(*) FROM inbox_processed_messages") }
	first := f.startChild("")
	f.waitFor("the first child's 20th payment", func() bool { return processed() >= 20 })
	killed := time.Now()
	if err := syscall.Kill(first.Pid(), syscall.SIGKILL); err != nil {
		tb.Fatal(err)
	}
	_ = first.WaitExit(tb, 10*time.Second)
	before := processed()
	if before >= n {
		tb.Fatalf("the first child processed all %d payments before the kill: nothing to measure", n)
	}
	successor := f.startChild("")
	defer func() { _ = successor.Kill() }() // this child only; tb's cleanup reaps it
	deadline := time.Now().Add(2 * time.Minute)
	var firstSettled time.Duration
	for {
		p := processed()
		if firstSettled == 0 && p > before {
			firstSettled = time.Since(killed)
		}
		if p == n {
			break
		}
		if time.Now().After(deadline) {
			tb.Fatalf("%d of %d payments processed 2 minutes after the kill", p, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
	all := time.Since(killed)
	if sum := f.count("SELECT sum(balance) FROM accounts"); sum != n {
		tb.Fatalf("balances sum to %d, want %d (each payment once)", sum, n)
	}
	tb.Logf("RECOVERY broker=%s first=%s all=%s (committed before the kill: %d of %d)",
		name, firstSettled.Round(time.Millisecond), all.Round(time.Millisecond), before, n)
	return RecoveryTimes{Broker: name, First: firstSettled, All: all, Before: before}
}

// BenchmarkRecovery runs MeasureRecovery b.N times (a fresh schema, topic and group each;
// go test's default -benchtime runs it once, as one run takes seconds) and reports the means
// as the metrics first-s and all-s (seconds from the kill to the successor's first and last
// committed payment); the meaningless ns/op is suppressed. An adapter's test package runs it
// as
//
//	func BenchmarkRecoveryAfterSIGKILL(b *testing.B) { adaptertest.BenchmarkRecovery(b, harness) }
//
// with go test -run '^$' -bench RecoveryAfterSIGKILL; the child is still the package's
// TestAdapterChild (h.ChildTest).
func BenchmarkRecovery(b *testing.B, h Harness) {
	b.Helper()
	var first, all time.Duration
	for range b.N {
		r := MeasureRecovery(b, h)
		first += r.First
		all += r.All
	}
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(first.Seconds()/float64(b.N), "first-s")
	b.ReportMetric(all.Seconds()/float64(b.N), "all-s")
}
