package tests

// This file runs the demo, examples/billing (what `make demo` runs), end to end as a user would:
// built into a binary, run against the machine's PostgreSQL and a broker, judged by its exit
// status and its summary, on every broker: PostgreSQL (watermill-sql), RabbitMQ, Kafka (an
// in-process kfake the demo starts), SQS (an in-process goaws the demo starts), NATS JetStream and
// Redis Streams. The demo itself crashes its consumer three times and verifies the
// balances, the dead-lettered poison payments and the receipts counted downstream.
//
// These tests are deliberately not t.Parallel: pgrestart_test.go restarts the shared PostgreSQL
// server and must not overlap with anything that uses it.

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	natsgo "github.com/nats-io/nats.go"
	goredis "github.com/redis/go-redis/v9"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

// TestDemoBilling runs the demo on every broker, one subtest each (the demo binary is built
// once).
func TestDemoBilling(t *testing.T) {
	testenv.SkipShort(t, "PostgreSQL") // before building the demo: every broker's run needs it
	bin := demoBuild(t)
	for _, tc := range []struct {
		broker string
		// require fails the test (with testenv's hint) when the broker is down; nil: the
		// demo starts the broker in-process (kafka: kfake, sqs: goaws).
		require func(testing.TB) string
		// check looks at the broker after a successful run: the run's topics are deleted.
		check func(t *testing.T, out string)
	}{
		{broker: "postgres"},
		{broker: "amqp", require: testenv.RequireAMQP, check: demoCheckQueueDeleted},
		{broker: "kafka"},
		{broker: "sqs"},
		{broker: "nats", require: testenv.RequireNATS, check: demoCheckStreamsDeleted},
		{broker: "redis", require: testenv.RequireRedis, check: demoCheckRedisKeysDeleted},
	} {
		t.Run(tc.broker, func(t *testing.T) {
			if tc.require != nil {
				tc.require(t)
			}
			out := demoRun(t, bin, tc.broker)
			demoCheckSchemaDropped(t, out)
			if tc.check != nil {
				tc.check(t, out)
			}
		})
	}
}

// demoCheckStreamsDeleted checks that a successful NATS run deleted its streams.
func demoCheckStreamsDeleted(t *testing.T, out string) {
	t.Helper()
	nc, err := natsgo.Connect(testenv.NATSURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		t.Fatal(err)
	}
	for _, stream := range demoTopics(t, out) {
		if _, err := js.StreamInfo(stream); !errors.Is(err, natsgo.ErrStreamNotFound) {
			t.Errorf("stream %s: %v after a successful run, want it deleted", stream, err)
		}
	}
}

// demoCheckRedisKeysDeleted checks that a successful Redis run deleted its streams.
func demoCheckRedisKeysDeleted(t *testing.T, out string) {
	t.Helper()
	opts, err := goredis.ParseURL(testenv.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	rc := goredis.NewClient(opts)
	defer rc.Close()
	n, err := rc.Exists(context.Background(), demoTopics(t, out)...).Result()
	if err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("%d of the run's streams still exist after a successful run", n)
	}
}

// demoRun builds and runs the demo with small numbers, fails t unless it exits 0 with the
// expected summary, and returns its output.
func demoRun(t *testing.T, bin, broker string) string {
	t.Helper()
	// Fail (never skip) with testenv's hint when PostgreSQL is down.
	testenv.NewPool(t, testenv.DatabaseURL(), 1)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin,
		"-broker="+broker,
		"-messages=400", "-accounts=20", "-dup-ratio=0.25",
		"-poison=3", "-max-attempts=3",
		"-timeout=100s")
	cmd.Env = append(os.Environ(), "INBOX_DATABASE_URL="+testenv.DatabaseURL(), "INBOX_AMQP_URL="+testenv.AMQPURL(),
		"INBOX_NATS_URL="+testenv.NATSURL(), "INBOX_REDIS_URL="+testenv.RedisURL())
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	out := stdout.String()
	t.Logf("demo -broker=%s took %s:\n%s", broker, time.Since(start).Round(time.Millisecond), out)
	if stderr.Len() > 0 {
		t.Logf("stderr:\n%s", stderr.String())
	}
	if err != nil {
		t.Fatalf("demo -broker=%s: %v (want exit status 0)", broker, err)
	}

	lines := strings.Split(strings.TrimSpace(out), "\n")
	if last := lines[len(lines)-1]; last != "OK" {
		t.Errorf("last line = %q, want OK", last)
	}
	for _, want := range []string{
		`^billing demo: broker=` + broker + ` `,
		`^published\s+500 deliveries: 400 unique payments over 20 accounts \+ 100 re-sent with the same UUID`,
		`^consumer #1 SIGKILLed itself right after the inbox committed its 100th message, before the router acked it`,
		`^consumer #2 SIGKILLed by the orchestrator mid-stream, with a delivery claimed but uncommitted .*; inbox rows \d+/400$`,
		`^published\s+3 payments to frozen account 21: poison messages`,
		// The crash inside a poison payment's handler, between two of its attempts.
		`^consumer #3 SIGKILLed itself in the handler of poison payment \S+, on its attempt 2 of 3 .*; its inbox attempts row says 2$`,
		`^consumer #4 stopped with SIGTERM once every payment was processed or dead-lettered, every receipt counted and the broker drained`,
		`^inbox rows\s+400 = 400 unique message IDs`,
		`^balances\s+verified: 20/20 accounts equal the sum of their unique payments .*; frozen account 21: 0$`,
		// Each poison payment: one dead letter, read back from the broker; attempts row at 3;
		// 3 handler runs in all, from the rejection log written outside the inbox transaction.
		`^poison\s+dead-lettered 3/3 after 3 attempts each: each once on topic \S*payments_dead_letters, its attempts row at 3 and dead-lettered; handler ran 9 times, 3 per payment \(consumer #3: \d+, #4: \d+\); no balance changed$`,
		// One receipt per unique payment: outbox, relay, and the downstream inbox.
		`^receipts\s+counted 400 = 400 unique payments, one each, by the receipts inbox; it skipped \d+ duplicates`,
		// What the broker still holds for the billing consumer group after the stop.
		`^broker\s+0 left after the stop \(`,
		`^restarts\s+3 `,
	} {
		if !regexp.MustCompile(`(?m)` + want).MatchString(out) {
			t.Errorf("output has no line matching %q", want)
		}
	}
	return out
}

// demoBuild compiles examples/billing into t.TempDir(), with the race detector when this test
// binary has it.
func demoBuild(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "examples", "billing", "main.go")); err != nil {
		t.Fatalf("examples/billing not found from %s: %v", root, err)
	}
	bin := filepath.Join(t.TempDir(), "billing")
	args := []string{"build", "-o", bin}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "-race" && s.Value == "true" {
				args = append(args, "-race")
			}
		}
	}
	args = append(args, ".") // examples/billing is a module of its own (it embeds goaws)
	cmd := exec.Command("go", args...)
	cmd.Dir = filepath.Join(root, "examples", "billing")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return bin
}

var (
	demoSchemaRE = regexp.MustCompile(`(?m)^billing demo: .*schema=(billing_demo_[0-9a-f]+) `)
	demoTopicRE  = regexp.MustCompile(`(?m)^billing demo: .*topic=(\S+) `)
)

// demoCheckSchemaDropped checks that a successful run left no schema behind.
func demoCheckSchemaDropped(t *testing.T, out string) {
	t.Helper()
	m := demoSchemaRE.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("no schema name in the output")
	}
	pool := testenv.NewPool(t, testenv.DatabaseURL(), 1)
	var exists bool
	if err := pool.QueryRow(context.Background(), "SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", m[1]).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if exists {
		t.Errorf("schema %s still exists after a successful run", m[1])
	}
}

// demoTopics returns the run's three topics: payments, dead letters and receipts.
func demoTopics(t *testing.T, out string) []string {
	t.Helper()
	m := demoTopicRE.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("no topic in the output")
	}
	prefix, ok := strings.CutSuffix(m[1], "payments")
	if !ok {
		t.Fatalf("topic %q does not end in payments", m[1])
	}
	return []string{m[1], prefix + "payments_dead_letters", prefix + "receipts"}
}

// demoCheckQueueDeleted checks that a successful AMQP run deleted its queues: payments, dead
// letters and receipts.
func demoCheckQueueDeleted(t *testing.T, out string) {
	t.Helper()
	conn, err := amqp.NewConnection(amqp.ConnectionConfig{AmqpURI: testenv.AMQPURL()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for _, queue := range demoTopics(t, out) {
		// A passive declare of a missing queue fails with 404 NOT_FOUND and closes the
		// channel, so each queue gets a channel of its own.
		ch, err := conn.Connection().Channel()
		if err != nil {
			t.Fatal(err)
		}
		if q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil); err == nil {
			t.Errorf("queue %s still exists after a successful run (%d messages)", q.Name, q.Messages)
		}
		_ = ch.Close()
	}
}
