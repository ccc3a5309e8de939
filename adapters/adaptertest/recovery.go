package adaptertest

import (
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"
)

// EnvMeasureRecovery opts in to MeasureRecovery (any non-empty value). It is not set in CI:
// the measurement kills and restarts consumer processes and takes several seconds per broker.
const EnvMeasureRecovery = "INBOX_MEASURE_RECOVERY"

// MeasureRecovery measures how long a consumer group stands still after a consumer process is
// killed: it publishes 400 payments, starts a child consumer (one handler, the broker's
// defaults as h builds them), SIGKILLs it once it has committed 20, starts a successor at once,
// and reports the time from the kill to the successor's first committed payment (a new inbox
// row) and to the last one. It then checks every payment was applied exactly once (the sum of
// the balances is 400). It is skipped unless EnvMeasureRecovery is set; the figures are logged
// as "RECOVERY broker=<name> first=<duration> all=<duration>".
//
// The time includes the successor's start (a fresh process connecting to PostgreSQL and the
// broker), which is what an orchestrator restarting a killed pod pays as well.
func MeasureRecovery(t *testing.T, h Harness) {
	if os.Getenv(EnvMeasureRecovery) == "" {
		t.Skipf("set %s=1 to measure the recovery time after a SIGKILL", EnvMeasureRecovery)
	}
	if h.Timeout == 0 {
		h.Timeout = 30 * time.Second
	}
	if h.ChildTest == "" {
		h.ChildTest = "TestAdapterChild"
	}
	f := newFixture(t, h)
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
		t.Fatal(err)
	}
	_ = first.WaitExit(t, 10*time.Second)
	before := processed()
	if before >= n {
		t.Fatalf("the first child processed all %d payments before the kill: nothing to measure", n)
	}
	_ = f.startChild("")
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
			t.Fatalf("%d of %d payments processed 2 minutes after the kill", p, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
	all := time.Since(killed)
	if sum := f.count("SELECT sum(balance) FROM accounts"); sum != n {
		t.Fatalf("balances sum to %d, want %d (each payment once)", sum, n)
	}
	t.Logf("RECOVERY broker=%s first=%s all=%s (committed before the kill: %d of %d)",
		name, firstSettled.Round(time.Millisecond), all.Round(time.Millisecond), before, n)
}
