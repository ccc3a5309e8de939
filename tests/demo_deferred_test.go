package tests

// The demo in the store-then-process mode (examples/billing/deferred.go): a receiver SIGKILLed
// between its commit and its ack, a worker SIGKILLed mid-batch inside its handler, poison
// payments dead after -max-attempts, each account's payments applied in sequence order.

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

// TestDemoBillingStoreThenProcess runs the demo with -mode=store-then-process on PostgreSQL
// (watermill-sql), RabbitMQ and NATS JetStream, with small numbers, and checks its exit status,
// its summary (which the demo only prints after verifying each line against the database and
// the broker) and that a successful run dropped its schema and deleted its broker objects.
func TestDemoBillingStoreThenProcess(t *testing.T) {
	testenv.SkipShort(t, "PostgreSQL")
	bin := demoBuild(t)
	for _, tc := range []struct {
		broker  string
		require func(testing.TB) string
		check   func(t *testing.T, out string)
	}{
		{broker: "postgres"},
		{broker: "amqp", require: testenv.RequireAMQP, check: demoCheckQueueDeleted},
		{broker: "nats", require: testenv.RequireNATS, check: demoCheckStreamsDeleted},
	} {
		t.Run(tc.broker, func(t *testing.T) {
			if tc.require != nil {
				tc.require(t)
			}
			out := demoRunDeferred(t, bin, tc.broker)
			demoCheckSchemaDropped(t, out)
			if tc.check != nil {
				tc.check(t, out)
			}
		})
	}
}

// demoRunDeferred runs the demo in the store-then-process mode with 200 payments over 10
// accounts, fails t unless it exits 0 with the expected summary, and returns its output.
func demoRunDeferred(t *testing.T, bin, broker string) string {
	t.Helper()
	testenv.NewPool(t, testenv.DatabaseURL(), 1)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin,
		"-broker="+broker, "-mode=store-then-process",
		"-messages=200", "-accounts=10", "-dup-ratio=0.25",
		"-poison=3", "-max-attempts=3",
		"-timeout=100s")
	cmd.Env = append(os.Environ(), "INBOX_DATABASE_URL="+testenv.DatabaseURL(), "INBOX_AMQP_URL="+testenv.AMQPURL(),
		"INBOX_NATS_URL="+testenv.NATSURL(), "INBOX_REDIS_URL="+testenv.RedisURL())
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	out := stdout.String()
	t.Logf("demo -broker=%s -mode=store-then-process took %s:\n%s", broker, time.Since(start).Round(time.Millisecond), out)
	if stderr.Len() > 0 {
		t.Logf("stderr:\n%s", stderr.String())
	}
	if err != nil {
		t.Fatalf("demo -broker=%s -mode=store-then-process: %v (want exit status 0)", broker, err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if last := lines[len(lines)-1]; last != "OK" {
		t.Errorf("last line = %q, want OK", last)
	}
	for _, want := range []string{
		`^billing demo: broker=` + broker + ` `,
		`^mode\s+store-then-process: `,
		`^published\s+250 deliveries: 200 unique payments over 10 accounts \+ 50 re-sent with the same UUID`,
		// A receiver killed between its receipt's commit and the ack.
		`^consumer #1 SIGKILLed itself right after a receipt committed, once 50 payments were stored, before the router acked it .*; rows \d+/200 `,
		// A worker killed inside its handler: that row still processing, claimed by the dead
		// process, as are the rest of its claimed batches.
		`^consumer #2 SIGKILLed itself in a worker's handler after applying \d+ payments, transaction open \(payment \S+: still processing, attempt \d+\); [1-9]\d* rows of its claimed batches left in processing`,
		`^published\s+3 payments to frozen account 11: poison messages`,
		// The reaper of consumer #3 returned the dead worker's rows to pending.
		`^consumer #3 stopped with SIGTERM once every payment row was done, every poison row dead, .*reaped [1-9]\d*, `,
		`^rows\s+203 = 200 unique payments done \+ 3 poison dead, each published ID exactly once$`,
		`^balances\s+verified: 10/10 accounts equal the sum of their unique payments .*; frozen account 11: 0$`,
		`^poison\s+dead 3/3 after 3 attempts each: rows in status dead at 3 attempts, each dead-lettered once on topic \S*payments_dead_letters; handler ran 9 times, 3 per payment \(consumer #3: 9\); no balance changed$`,
		`^ordering\s+verified: each of the 10 accounts' payments applied once each, in sequence order 1\.\.n `,
		`^receipts\s+counted 200 = 200 unique payments, one each`,
		`^broker\s+0 left after the stop \(`,
		`^restarts\s+2 `,
	} {
		if !regexp.MustCompile(`(?m)` + want).MatchString(out) {
			t.Errorf("output has no line matching %q", want)
		}
	}
	return out
}
