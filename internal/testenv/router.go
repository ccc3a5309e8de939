package testenv

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// RunningRouter is a Watermill router running in its own goroutine.
type RunningRouter struct {
	Router *message.Router
	done   chan struct{}
	runErr error
}

// RunRouter runs router, waits until it is running and closes it when t ends. It fails t if
// Run returns first or the router is not running within 15 s.
func RunRouter(t testing.TB, router *message.Router) *RunningRouter {
	t.Helper()
	r := &RunningRouter{Router: router, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		r.runErr = router.Run(context.Background())
	}()
	select {
	case <-router.Running():
	case <-r.done:
		t.Fatalf("router stopped before running: %v", r.runErr)
	case <-time.After(15 * time.Second):
		t.Fatal("router did not start within 15s")
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// Close closes the router (in-flight deliveries finish first, subscribers close) and waits
// for Run to return.
func (r *RunningRouter) Close() error {
	err := r.Router.Close()
	select {
	case <-r.done:
	case <-time.After(20 * time.Second):
		return errors.Join(err, errors.New("router Run did not return within 20s"))
	}
	return errors.Join(err, r.runErr)
}
