package tests

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

// TestDemoSoakShort runs the demo's soak (what `make soak` runs with 100,000 payments) with
// 3,000 payments on Kafka (kfake, in process): the consumer is SIGKILLed at least once, and the
// soak must still verify every balance, the dead letters and every receipt once, and report
// the relay's backlog, a recovery time per SIGKILL and a graceful stop without an ERROR line.
func TestDemoSoakShort(t *testing.T) {
	testenv.SkipShort(t, "PostgreSQL")
	bin := demoBuild(t)
	testenv.NewPool(t, testenv.DatabaseURL(), 1) // fail (never skip) when PostgreSQL is down

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "-broker=kafka", "-soak", "-messages=3000", "-timeout=3m")
	cmd.Env = append(os.Environ(), "INBOX_DATABASE_URL="+testenv.DatabaseURL())
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	out := stdout.String()
	t.Logf("demo -soak:\n%s", out)
	if stderr.Len() > 0 {
		t.Logf("stderr:\n%s", stderr.String())
	}
	if err != nil {
		t.Fatalf("demo -soak: %v (want exit status 0)", err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if last := lines[len(lines)-1]; last != "OK" {
		t.Errorf("last line = %q, want OK", last)
	}
	for _, want := range []string{
		`^soak\s+consumer #1 SIGKILLed after \d+\.\ds; inbox rows \d+/3000; relay backlog now \d+ rows`,
		`^soak\s+consumer #2 settled its first delivery \d+\.\d+s after the last SIGKILL$`,
		`^stop\s+consumer #\d+'s graceful stop logged no ERROR line`,
		`^verified\s+3000 unique payments \(3600 deliveries, 600 of them re-sent duplicates\), every balance \(\d+ cents\), 3 dead letters, 3000 receipts once each; broker 0 left`,
		`^soak\s+[1-9]\d* SIGKILLs in .*; relay backlog never above \d+ rows \([1-9]\d* samples, at most \d+\.\d+s apart\)`,
		`^horizon\s+of that backlog, at most \d+ rows were visible to the relay`,
		`^recovery\s+SIGKILL to the next consumer's first settled delivery: min \d+\.\d+s, median \d+\.\d+s, max \d+\.\d+s \([1-9]\d* samples`,
	} {
		if !regexp.MustCompile(`(?m)` + want).MatchString(out) {
			t.Errorf("output has no line matching %q", want)
		}
	}
	demoCheckSchemaDropped(t, out)
}
