package inbox_test

import (
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// floodCopies and floodPool are the figures: 100 concurrent copies of one message
// with a pool of 5 connections.
const (
	floodCopies = 100
	floodPool   = 5
)

// flood delivers floodCopies concurrent copies of msg through h, each redelivered (as a
// broker would after a nack) until acked, and returns a function that waits for all of them.
func flood(h message.HandlerFunc, msg *message.Message) (wait func()) {
	var wg sync.WaitGroup
	for range floodCopies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for deliver(h, msg) != nil {
				time.Sleep(5 * time.Millisecond)
			}
		}()
	}
	return wg.Wait
}

// TestSameKeyFloodDoesNotStarveOtherKeys: 100 concurrent copies of one message, whose first
// delivery holds its claim for 4 s, with a pool of 5 connections and a ClaimTimeout of 3 s
// (shorter than the flood's hold): a copy gives its connection back at once (the key's lock
// is tried, never waited for) and waits without one, so 40 unrelated messages delivered meanwhile are each processed at their
// first delivery (before, the copies held every connection until the first committed, and
// the unrelated claims timed out waiting for a connection). The flood's message is applied
// exactly once; nothing is counted or dead-lettered; with attempt counting on (every copy
// counts first) as well as without.
func TestSameKeyFloodDoesNotStarveOtherKeys(t *testing.T) {
	for _, counted := range []bool{false, true} {
		name := "plain"
		if counted {
			name = "counted"
		}
		t.Run(name, func(t *testing.T) { testSameKeyFlood(t, counted) })
	}
}

func testSameKeyFlood(t *testing.T, counted bool) {
	e := newEnv(t, floodPool)
	mods := []func(*inbox.Config){func(c *inbox.Config) { c.ClaimTimeout = 3 * time.Second }}
	var dl *deadLetters
	if counted {
		dl = newDeadLetters(t)
		mods = append(mods, withDeadLetters(dl, 2))
	}
	ib := e.inbox("billing", mods...)
	var floodRuns atomic.Int64
	started := make(chan struct{})
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if msg.UUID == "m-flood" && floodRuns.Add(1) == 1 {
			close(started)
			time.Sleep(4 * time.Second)
		}
		return e.credit(msg)
	})
	msg := paymentMsg("m-flood", 1, 7)
	first := make(chan error, 1)
	go func() { first <- deliver(h, msg) }()
	<-started
	wait := flood(h, msg)
	time.Sleep(100 * time.Millisecond) // let the copies take the pool
	const others = 40
	for i := range others {
		m := paymentMsg("m-other-"+strconv.Itoa(i), 2, 1)
		if err := deliver(h, m); err != nil {
			t.Fatalf("unrelated message %d failed during the flood: %v", i+1, err)
		}
	}
	if r := floodRuns.Load(); r != 1 {
		t.Fatalf("the flood's message ran %d times before the first committed", r)
	}
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	wait()
	if b1, b2 := e.balance(1), e.balance(2); b1 != 7 || b2 != others {
		t.Fatalf("balances %d and %d; want 7 (the flood's message once) and %d", b1, b2, others)
	}
	if r, n := floodRuns.Load(), e.rows(""); r != 1 || n != others+1 {
		t.Fatalf("flood handler runs %d, inbox rows %d; want 1 and %d", r, n, others+1)
	}
	if s := ib.Stats(); s.Processed != others+1 || s.DeadLettered != 0 {
		t.Fatalf("stats %+v", s)
	}
	if counted {
		if r := e.attemptRows(); r != 0 {
			t.Fatalf("%d attempt rows left: a copy's wait was counted", r)
		}
		dl.wait(t, 0)
	}
}

// BenchmarkUnrelatedKeyUnderFlood measures one unrelated message's delivery (claim, handler,
// commit) while 100 copies of another message wait behind its slow first delivery, with a
// pool of 5. Compare with BenchmarkUnrelatedKeyNoFlood:
//
//	go test -run '^$' -bench 'UnrelatedKey' -benchtime 200x -count 3 ./middleware/inbox/
func BenchmarkUnrelatedKeyUnderFlood(b *testing.B) { benchUnrelated(b, true) }

// BenchmarkUnrelatedKeyNoFlood is BenchmarkUnrelatedKeyUnderFlood's baseline, without the
// flood.
func BenchmarkUnrelatedKeyNoFlood(b *testing.B) { benchUnrelated(b, false) }

func benchUnrelated(b *testing.B, withFlood bool) {
	sch := testenv.NewSchema(b, floodPool)
	sch.Store(b) // migrated
	// The default configuration: a claim tries its key's lock.
	store, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name})
	if err != nil {
		b.Fatal(err)
	}
	sch.CreateAccounts(b, 2)
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing"}, nil)
	if err != nil {
		b.Fatal(err)
	}
	hold := make(chan struct{})
	started := make(chan struct{})
	var once sync.Once
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if msg.UUID == "m-flood" {
			once.Do(func() { close(started); <-hold })
		}
		tx, _ := pgstore.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 1 WHERE id = 2")
		return nil, err
	})
	var wait func()
	if withFlood {
		go func() { _ = deliver(h, paymentMsg("m-flood", 1, 7)) }()
		<-started
		wait = flood(h, paymentMsg("m-flood", 1, 7))
		time.Sleep(100 * time.Millisecond)
	}
	b.ResetTimer()
	for i := range b.N {
		if err := deliver(h, paymentMsg("bench-"+strconv.Itoa(i), 2, 1)); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	close(hold)
	if wait != nil {
		wait()
	}
}
