//go:build unix

package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// child is one run of the consumer process.
type child struct {
	n   int // 1-based run number
	cmd *exec.Cmd

	mu     sync.Mutex
	lines  []string // stdout lines
	stderr bytes.Buffer

	ready chan struct{} // closed on the READY line
	done  chan struct{} // closed after Wait returned
	state *os.ProcessState

	// stopFrom is the length of stderr when the orchestrator sent SIGTERM (-1: never sent):
	// what follows it was logged by the graceful stop.
	stopFrom int
}

// lockedWriter serialises writes to the child's stderr buffer (and, with -v, os.Stderr).
type lockedWriter struct {
	c    *child
	tee  io.Writer
	lead string
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.c.mu.Lock()
	defer w.c.mu.Unlock()
	if w.tee != nil {
		for _, l := range strings.SplitAfter(string(p), "\n") {
			if l != "" {
				fmt.Fprint(w.tee, w.lead+l)
			}
		}
	}
	return w.c.stderr.Write(p)
}

// crashPoint says where a consumer SIGKILLs itself; the zero value: never.
type crashPoint struct {
	// afterCommits: right after the inbox committed this many payments, before the ack.
	afterCommits int
	// onRejection: in the handler, when a poison payment is rejected for this many times.
	onRejection int
	// afterApplied (store-then-process mode): in a worker's handler, after this many payments
	// applied, with the row's transaction open.
	afterApplied int
}

// startConsumer re-executes this binary with -role=consumer.
func (d *demo) startConsumer(crash crashPoint) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find own executable: %w", err)
	}
	d.children++
	c := &child{n: d.children, ready: make(chan struct{}), done: make(chan struct{}), stopFrom: -1}
	c.cmd = exec.Command(exe,
		"-role="+roleConsumer,
		"-broker="+d.o.broker,
		"-db="+d.o.db,
		fmt.Sprintf("-run=%d", c.n),
		"-schema="+d.schema,
		"-topic="+d.topics.payments,
		"-dead-letter-topic="+d.topics.deadLetters,
		"-receipts-topic="+d.topics.receipts,
		fmt.Sprintf("-max-attempts=%d", d.o.maxAttempts),
		fmt.Sprintf("-crash-after=%d", crash.afterCommits),
		fmt.Sprintf("-crash-on-rejection=%d", crash.onRejection),
		fmt.Sprintf("-amqp-consumers=%d", d.o.amqpConsumers),
		"-timeout="+d.o.timeout.String(), // the AMQP queues' x-expires (withDemoSettings)
		"-app-name="+d.consumerAppName(c.n),
		"-metrics-addr="+d.o.metricsAddr,
		"-mode="+d.o.mode,
		fmt.Sprintf("-crash-after-applied=%d", crash.afterApplied),
	)
	if d.o.sharded() {
		c.cmd.Args = append(c.cmd.Args, fmt.Sprintf("-shards=%d", d.o.shards))
	}
	// The consumer builds its broker from the environment (router.ConfigFromEnv).
	c.cmd.Env = append(os.Environ(), "INBOX_DATABASE_URL="+databaseURL(), "INBOX_MYSQL_DSN="+mysqlDSN())
	c.cmd.Env = append(c.cmd.Env, d.broker.env...)
	c.cmd.SysProcAttr = childProcAttr() // the child dies with the orchestrator
	var tee io.Writer
	if d.o.verbose {
		tee = os.Stderr
	}
	c.cmd.Stderr = lockedWriter{c: c, tee: tee, lead: fmt.Sprintf("[consumer #%d] ", c.n)}
	stdout, err := c.cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := c.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start consumer: %w", err)
	}
	d.running = c
	d.all = append(d.all, c)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line := sc.Text()
			c.mu.Lock()
			c.lines = append(c.lines, line)
			c.mu.Unlock()
			if strings.HasPrefix(line, lineReady+" ") {
				close(c.ready)
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
		_ = c.cmd.Wait()
		c.state = c.cmd.ProcessState
		close(c.done)
	}()
	return c, nil
}

func (d *demo) consumerAppName(n int) string {
	return fmt.Sprintf("billing-demo-%s-consumer-%d", d.runID, n)
}

func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// wait waits for the process to exit, at most until ctx is done.
func (c *child) wait(ctx context.Context) error {
	select {
	case <-c.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("consumer #%d did not exit: %w", c.n, ctx.Err())
	}
}

func (c *child) signal(sig syscall.Signal) {
	if !c.exited() {
		_ = c.cmd.Process.Signal(sig)
	}
}

// killAndWait SIGKILLs the process and waits for it; a dead process needs no deadline beyond
// the kernel's, but bound it anyway.
func (c *child) killAndWait() {
	c.signal(syscall.SIGKILL)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = c.wait(ctx)
}

// killedBySIGKILL reports whether the exited process died of SIGKILL.
func (c *child) killedBySIGKILL() bool {
	ws, ok := c.state.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// report returns the JSON of the last stdout line starting with kind.
func (c *child) report(kind string) (consumerReport, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := len(c.lines) - 1; i >= 0; i-- {
		if rest, ok := strings.CutPrefix(c.lines[i], kind+" "); ok {
			var r consumerReport
			if json.Unmarshal([]byte(rest), &r) == nil {
				return r, true
			}
		}
	}
	return consumerReport{}, false
}

// stderrContains reports whether the child wrote substr to stderr.
func (c *child) stderrContains(substr string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return bytes.Contains(c.stderr.Bytes(), []byte(substr))
}

// stop sends SIGTERM and remembers where stderr stood, for stopLog.
func (c *child) stop() {
	c.mu.Lock()
	c.stopFrom = c.stderr.Len()
	c.mu.Unlock()
	c.signal(syscall.SIGTERM)
}

// stopLog returns what the child wrote to stderr after stop sent SIGTERM ("" if it was never
// sent): the log of its graceful stop.
func (c *child) stopLog() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopFrom < 0 {
		return ""
	}
	return string(c.stderr.Bytes()[c.stopFrom:])
}

// stderrTail returns the last lines the child wrote to stderr, for a FAIL report.
func (c *child) stderrTail(n int) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	lines := strings.Split(strings.TrimRight(c.stderr.String(), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (c *child) describeExit() string {
	if c.state == nil {
		return "still running"
	}
	return c.state.String()
}
