package inboxtest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// ChildMaxLifetime bounds how long a child test process started by StartChild may run: the
// child's -test.timeout is ChildMaxLifetime plus 30s, and WaitChildStop gives up after it.
const ChildMaxLifetime = 60 * time.Second

// childOutputLinePrefix precedes each child output line logged on the parent's t.
const childOutputLinePrefix = "child: "

// Child is a running child process: the test binary re-executed to run one test function, as
// started by StartChild.
type Child struct {
	cmd  *exec.Cmd
	out  *lineLog
	done chan struct{}
	err  error // cmd.Wait's result, once done is closed
}

// lineLog collects the child's output lines and logs them on t.
type lineLog struct {
	t       testing.TB
	mu      sync.Mutex
	partial []byte
	lines   []string
}

// Write implements io.Writer: it splits p into lines, keeps them and logs each on l.t.
func (l *lineLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.partial = append(l.partial, p...)
	for {
		i := strings.IndexByte(string(l.partial), '\n')
		if i < 0 {
			break
		}
		line := string(l.partial[:i])
		l.partial = l.partial[i+1:]
		l.lines = append(l.lines, line)
		l.t.Log(childOutputLinePrefix + line)
	}
	return len(p), nil
}

// find returns the first line starting with prefix.
func (l *lineLog) find(prefix string) (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if strings.HasPrefix(line, prefix) {
			return line, true
		}
	}
	return "", false
}

// StartChild re-executes the test binary (os.Args[0]) to run only the test testName, with the
// parent's environment plus env ("KEY=value" entries). The child's stdout and stderr lines are
// collected (see Find) and logged on t. The child is SIGKILLed (by its pid) when t ends if it
// still runs. StartChild does not wait for the child to become ready; use WaitLine.
func StartChild(t testing.TB, testName string, env []string) *Child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^"+testName+"$", "-test.count=1", "-test.v=false",
		fmt.Sprintf("-test.timeout=%s", ChildMaxLifetime+30*time.Second))
	cmd.Env = append(os.Environ(), env...)
	out := &lineLog{t: t}
	cmd.Stdout = out
	cmd.Stderr = out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start child: %v", err)
	}
	c := &Child{cmd: cmd, out: out, done: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		close(c.done)
	}()
	t.Cleanup(func() {
		select {
		case <-c.done:
			return
		default:
		}
		_ = cmd.Process.Kill() // this child only, by its pid
		select {
		case <-c.done:
		case <-time.After(10 * time.Second):
			t.Errorf("child %d did not exit after SIGKILL", cmd.Process.Pid)
		}
	})
	return c
}

// Pid returns the child's process id.
func (c *Child) Pid() int { return c.cmd.Process.Pid }

// Kill SIGKILLs the child (by its pid); it does not wait for the child to exit.
func (c *Child) Kill() error { return c.cmd.Process.Kill() }

// Signal sends sig to the child (by its pid).
func (c *Child) Signal(sig os.Signal) error { return c.cmd.Process.Signal(sig) }

// Find returns the first output line of the child so far that starts with prefix.
func (c *Child) Find(prefix string) (string, bool) { return c.out.find(prefix) }

// WaitLine waits for an output line starting with prefix and returns it; it fails t when the
// child exits or timeout passes first.
func (c *Child) WaitLine(t testing.TB, prefix string, timeout time.Duration) string {
	t.Helper()
	deadline := time.After(timeout)
	for {
		if line, ok := c.out.find(prefix); ok {
			return line
		}
		select {
		case <-c.done:
			if line, ok := c.out.find(prefix); ok {
				return line
			}
			t.Fatalf("child %d exited (%v) before printing %q", c.Pid(), c.err, prefix)
		case <-deadline:
			t.Fatalf("child %d did not print %q within %s", c.Pid(), prefix, timeout)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Exited reports, without waiting, whether the child has exited, and cmd.Wait's error if so.
func (c *Child) Exited() (bool, error) {
	select {
	case <-c.done:
		return true, c.err
	default:
		return false, nil
	}
}

// WaitExit waits for the child to exit and returns cmd.Wait's error; it fails t after timeout.
func (c *Child) WaitExit(t testing.TB, timeout time.Duration) error {
	t.Helper()
	select {
	case <-c.done:
		return c.err
	case <-time.After(timeout):
		t.Fatalf("child %d did not exit within %s", c.Pid(), timeout)
		return nil
	}
}

// Stop sends SIGTERM, waits up to 30s for the child to exit cleanly and returns its first
// output line starting with prefix (e.g. "STATS "); it fails t when any of these fails.
func (c *Child) Stop(t testing.TB, prefix string) string {
	t.Helper()
	if err := c.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("SIGTERM child %d: %v", c.Pid(), err)
	}
	if err := c.WaitExit(t, 30*time.Second); err != nil {
		t.Fatalf("child %d did not exit cleanly: %v", c.Pid(), err)
	}
	line, ok := c.Find(prefix)
	if !ok {
		t.Fatalf("child %d printed no %s line", c.Pid(), strings.TrimSpace(prefix))
	}
	return line
}

// KilledBySIGKILL reports whether a cmd.Wait error (e.g. from WaitExit) says the process died
// of SIGKILL.
func KilledBySIGKILL(err error) bool {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// WaitChildStop is the waiting part of a child's test function: it returns when ctx is done
// (e.g. on SIGTERM), when the parent process is gone (the child was re-parented) or after
// ChildMaxLifetime, so an orphan never outlives its test run for long. The latter two fail t;
// what names the child in that failure ("child consumer", "child").
func WaitChildStop(t testing.TB, ctx context.Context, what string) {
	t.Helper()
	ppid := os.Getppid()
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	limit := time.After(ChildMaxLifetime)
	for {
		select {
		case <-ctx.Done():
			return
		case <-limit:
			t.Errorf("%s ran longer than %s", what, ChildMaxLifetime)
			return
		case <-tick.C:
			if os.Getppid() != ppid {
				t.Errorf("parent process %d is gone", ppid)
				return
			}
		}
	}
}
