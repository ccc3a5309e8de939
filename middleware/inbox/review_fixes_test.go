package inbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// holdClaim inserts the claim row of id in a transaction left open (another consumer's
// delivery in flight, or an operator's lock), until the returned function rolls it back.
func holdClaim(t *testing.T, e *env, id string) (release func()) {
	t.Helper()
	ctx := context.Background()
	tx, err := e.sch.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO inbox_processed_messages (message_id, consumer_name) VALUES ($1, 'billing')", id); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { _ = tx.Rollback(ctx) }) }
	t.Cleanup(release)
	return release
}

// TestClaimFailuresDoNotCountAsAttempts: deliveries that fail before the handler runs (the
// claim waits on a row locked by another transaction past LockTimeout, SQLSTATE 55P03) must
// not bring a healthy message to the dead-letter topic.
func TestClaimFailuresDoNotCountAsAttempts(t *testing.T) {
	e := newEnv(t, 6)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 2), e.withLockTimeout(100*time.Millisecond), func(c *inbox.Config) {
		c.ClaimTimeout = 1500 * time.Millisecond
	})
	h := ib.Middleware(e.credit)
	msg := paymentMsg("m-locked", 1, 42)
	// Warm the statement cache first, so the pipeline itself meets the lock.
	if err := deliver(h, paymentMsg("m-warm", 2, 1)); err != nil {
		t.Fatal(err)
	}
	release := holdClaim(t, e, msg.UUID)
	for i := range 4 {
		start := time.Now()
		if err := deliver(h, msg); err == nil {
			t.Fatalf("delivery %d succeeded while the inbox table was locked", i+1)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("delivery %d waited %v on the lock; the claim must be bounded", i+1, d)
		}
	}
	release()
	if err := deliver(h, msg); err != nil {
		t.Fatalf("after the lock was released: %v", err)
	}
	if b := e.balance(1); b != 42 {
		t.Fatalf("balance %d, want 42: a message that never reached its handler was dead-lettered", b)
	}
	if s := ib.Stats(); s.DeadLettered != 0 || s.Processed != 2 {
		t.Fatalf("stats %+v", s)
	}
	if n, _, _ := e.attemptsRow(msg.UUID); n != 0 {
		t.Fatalf("attempt record left behind: %d", n)
	}
}

// TestLockTimeoutWithDeadLetters: with attempt counting on, a concurrent duplicate first
// waits in the attempt upsert behind the first delivery's transaction; LockTimeout must bound
// that wait too.
func TestLockTimeoutWithDeadLetters(t *testing.T) {
	e := newEnv(t, 4)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 5), e.withLockTimeout(100*time.Millisecond))
	started := make(chan struct{})
	slow := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		out, err := e.credit(msg)
		close(started)
		time.Sleep(800 * time.Millisecond)
		return out, err
	})
	msg := paymentMsg("m-slow-dl", 3, 60)
	first := make(chan error, 1)
	go func() { first <- deliver(slow, msg) }()
	<-started
	begin := time.Now()
	if err := deliver(ib.Middleware(e.credit), msg); err == nil {
		t.Fatal("a duplicate behind a slow handler was acked before the first committed")
	}
	if waited := time.Since(begin); waited > 600*time.Millisecond {
		t.Fatalf("the duplicate waited %v with a 100 ms lock timeout", waited)
	}
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if err := deliver(ib.Middleware(e.credit), msg); err != nil {
		t.Fatal(err)
	}
	if b, r := e.balance(3), e.runs.Load(); b != 60 || r != 1 {
		t.Fatalf("balance %d, handler runs %d; want 60, 1", b, r)
	}
}

// TestCommitOutcomeUnknownIsNeverDeadLettered: on the last allowed attempt the answer to
// COMMIT is lost; the transaction did commit, so the message must not be dead-lettered.
func TestCommitOutcomeUnknownIsNeverDeadLettered(t *testing.T) {
	e := newEnv(t, 1)
	dl := newDeadLetters(t)
	proxy := testenv.NewProxy(t, testenv.DatabaseHostPort(t))
	pool := testenv.NewPool(t, testenv.WithHost(t, e.sch.URL, proxy.Addr), 1)
	store, err := pgstore.New(pool, pgstore.Config{Schema: e.sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	ib := e.inbox("billing", withDeadLetters(dl, 1), func(c *inbox.Config) { c.Store = store; c.FinishTimeout = 300 * time.Millisecond })
	lose := true
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		out, err := e.credit(msg)
		if lose {
			proxy.Hold()
		}
		return out, err
	})
	// A first message on the one connection: its statements are prepared, so the lost answer
	// below is COMMIT's, not a prepare's.
	lose = false
	if err := deliver(h, paymentMsg("m-warm", 5, 1)); err != nil {
		t.Fatal(err)
	}
	lose = true
	msg := paymentMsg("m-unknown", 4, 400)
	if err := deliver(h, msg); err == nil {
		t.Fatal("a commit whose answer never arrived returned success")
	}
	lose = false
	// The redelivery is counted first; the count connection lost its answers too, so the
	// first redelivery's count can fail (a nack, nothing counted for certain); the next one
	// counts on a new connection and resolves as a duplicate.
	for range 3 {
		if err = deliver(h, msg); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatalf("redelivery: %v", err)
	}
	time.Sleep(50 * time.Millisecond)
	dl.wait(t, 0)
	if b, s := e.balance(4), ib.Stats(); b != 400 || s.Duplicates != 1 || s.DeadLettered != 0 {
		t.Fatalf("balance %d, stats %+v; want 400, one duplicate, no dead letter", b, s)
	}
}
