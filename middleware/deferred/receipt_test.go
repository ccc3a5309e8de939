package deferred_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// TestReceiptSequentialDuplicate: the same message received twice is stored once, the second
// receipt acks without storing, and the workers credit it once.
func TestReceiptSequentialDuplicate(t *testing.T) {
	ib, s := newInbox(t, deferred.Config{}, 1)
	for range 2 {
		if err := ib.Receive(payment("dup-1", 1, 700, 0)); err != nil {
			t.Fatalf("receive: %v", err)
		}
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred"); n != 1 {
		t.Fatalf("%d rows, want 1", n)
	}
	if c := ib.Counters(); c.Received != 1 || c.Duplicates != 1 {
		t.Fatalf("counters %+v, want 1 received and 1 duplicate", c)
	}
	runWorkers(t, ib.NewConsumerWorkers(credit))
	waitFor(t, 10*time.Second, "the row done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 1
	})
	// A third copy after processing is still a duplicate.
	if err := ib.Receive(payment("dup-1", 1, 700, 0)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if b := count(t, s.Pool, "SELECT balance FROM accounts WHERE id = 1"); b != 700 {
		t.Fatalf("balance %d, want 700 (credited once)", b)
	}
}

// TestReceiptConcurrentDuplicate: eight copies released together at a barrier, each on its
// own connection: all are acked, one row is stored.
func TestReceiptConcurrentDuplicate(t *testing.T) {
	ib, s := newInbox(t, deferred.Config{}, 1)
	for round := range 5 {
		key := "conc-" + string(rune('a'+round))
		var start, wg sync.WaitGroup
		start.Add(1)
		errs := make([]error, 8)
		for k := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				m := payment(key, 1, 100, 0)
				start.Wait()
				errs[k] = ib.Receive(m)
			}()
		}
		start.Done()
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				t.Fatalf("receive: %v", err)
			}
		}
		if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE message_id = $1", key); n != 1 {
			t.Fatalf("%s: %d rows, want 1", key, n)
		}
	}
	if c := ib.Counters(); c.Received != 5 || c.Duplicates != 35 {
		t.Fatalf("counters %+v, want 5 received, 35 duplicates", c)
	}
}

// TestReceiptRefusals: a key collision and invalid keys, sequences and metadata are
// dead-lettered with the PoisonQueue keys (or refused without a dead-letter topic); nothing is
// stored for them.
func TestReceiptRefusals(t *testing.T) {
	dlq := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = dlq.Close() })
	letters, err := dlq.Subscribe(context.Background(), "dead")
	if err != nil {
		t.Fatal(err)
	}
	ib, s := newInbox(t, deferred.Config{DeadLetterPublisher: dlq, DeadLetterTopic: "dead",
		Ordering: deferred.OrderProducerSequence, SequenceField: "seq"}, 1)
	if err := ib.Receive(payment("k1", 1, 100, 1)); err != nil {
		t.Fatal(err)
	}
	bad := []*message.Message{
		payment("k1", 1, 999, 1), // collision: same key, another payload
		payment("", 1, 100, 1),   // empty key
		payment("k2", 1, 100, 0), // an aggregate without a sequence
	}
	nul := payment("k3", 1, 100, 2)
	nul.Metadata.Set("note", "a\x00b")
	bad = append(bad, nul)
	for _, m := range bad {
		if err := ib.Receive(m); err != nil {
			t.Fatalf("receive %q: %v (want a dead letter and an ack)", m.UUID, err)
		}
	}
	for k := range bad {
		select {
		case dl := <-letters:
			dl.Ack()
			if dl.Metadata.Get(wmmiddleware.ReasonForPoisonedKey) == "" || dl.Metadata.Get(inbox.DeadLetterConsumerKey) != "billing" {
				t.Fatalf("dead letter %d lacks its metadata: %v", k, dl.Metadata)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("dead letter %d missing", k)
		}
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred"); n != 1 {
		t.Fatalf("%d rows, want 1", n)
	}
	if c := ib.Counters(); c.Collisions != 1 || c.Refused != 3 {
		t.Fatalf("counters %+v", c)
	}

	// Without a dead-letter topic: the errors go to the router (nack).
	plain := inboxOn(t, s.Pool, s.Name, deferred.Config{ConsumerName: "plain", OnKeyCollision: inbox.CollisionReject})
	if err := plain.Receive(payment("k1", 1, 100, 0)); err != nil {
		t.Fatal(err)
	}
	if err := plain.Receive(payment("k1", 1, 5, 0)); !errors.Is(err, inbox.ErrKeyCollision) {
		t.Fatalf("collision: %v, want ErrKeyCollision", err)
	}
	if err := plain.Receive(payment("", 1, 5, 0)); !errors.Is(err, inbox.ErrInvalidKey) {
		t.Fatalf("empty key: %v, want ErrInvalidKey", err)
	}
}

// TestNotifyWakesIdleWorkers: with a 30 s poll interval, idle workers still pick a new row up
// within seconds: the receipt's notification (LISTEN on a dedicated connection) woke them.
func TestNotifyWakesIdleWorkers(t *testing.T) {
	ib, s := newInbox(t, deferred.Config{PollInterval: 30 * time.Second}, 1)
	runWorkers(t, ib.NewConsumerWorkers(credit))
	time.Sleep(500 * time.Millisecond) // the first poll is over; the LISTEN is in place
	for k := range 3 {
		start := time.Now()
		if err := ib.Receive(payment("wake-"+string(rune('a'+k)), 1, 1, 0)); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 10*time.Second, "the row done", func() bool {
			return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == int64(k+1)
		})
		t.Logf("receipt to done: %s", time.Since(start))
	}
}
