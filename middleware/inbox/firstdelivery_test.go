package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// TestFirstDeliveryLeavesTheAttemptsTableAlone: with a dead-letter topic and a broker that
// signals first deliveries, a first delivery that succeeds is claimed and committed without
// touching the attempts table (CountedClaimParams.NoRecord: the dead-letter path costs what
// the plain inbox costs). Another transaction holds the attempts table in ACCESS EXCLUSIVE
// mode, which blocks any statement that reads or writes it: the first delivery is applied
// while the lock is held, and a flagged redelivery of another message, which reads the
// record, waits for the lock (so the lock does block what touches the table).
func TestFirstDeliveryLeavesTheAttemptsTableAlone(t *testing.T) {
	e := newEnv(t, 4)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 3), func(c *inbox.Config) { c.Redelivery = redeliveryFromFlag })
	h := ib.Middleware(e.credit)

	ctx := context.Background()
	lock, err := e.sch.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }()
	if _, err := lock.Exec(ctx, "LOCK TABLE inbox_processed_messages_attempts IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}

	first := make(chan error, 1)
	go func() { first <- deliver(h, paymentMsg("m-first", 1, 7)) }()
	select {
	case err := <-first:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a first delivery waited for the attempts table's lock: it touched the table")
	}
	if b := e.balance(1); b != 7 {
		t.Fatalf("balance %d while the attempts table was locked, want 7", b)
	}

	redelivered := paymentMsg("m-redelivered", 2, 5)
	redelivered.Metadata.Set(redeliveredKey, "true")
	second := make(chan error, 1)
	go func() { second <- deliver(h, redelivered) }()
	select {
	case err := <-second:
		t.Fatalf("a redelivery did not wait for the attempts table's lock (err %v): the lock proves nothing", err)
	case <-time.After(300 * time.Millisecond):
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-second; err != nil {
		t.Fatal(err)
	}
	if b := e.balance(2); b != 5 {
		t.Fatalf("redelivered payment: balance %d, want 5", b)
	}
	e.settled(dl, 1, 7)
}

// TestFirstDeliveryLeavesAnotherCopysRecordToIt: a first delivery neither reads nor clears
// the key's attempt record, so when it succeeds while another copy of the message has a
// record (a copy that failed, or whose consumer crashed, and awaits its redelivery), the
// record stays until that copy's redelivery, which is a duplicate and clears it. The message
// is applied once, nothing is dead-lettered, and no attempt row is left once every copy has
// settled; at each isolation level. A first delivery of a key with crashed attempts is not
// isolated either (it is no suspect: it read nothing).
func TestFirstDeliveryLeavesAnotherCopysRecordToIt(t *testing.T) {
	for _, iso := range []sql.IsolationLevel{sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable} {
		for _, earlier := range []string{"failed", "crashed"} {
			t.Run(iso.String()+"/"+earlier, func(t *testing.T) {
				e := newEnv(t, 4)
				dl := newDeadLetters(t)
				ib := e.inbox("billing", withDeadLetters(dl, 3), func(c *inbox.Config) {
					c.Redelivery = redeliveryFromFlag
					c.Isolation = iso
				})
				fail := true
				h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					if _, err := e.credit(msg); err != nil {
						return nil, err
					}
					if fail {
						fail = false
						return nil, errors.New("downstream timeout")
					}
					return nil, nil
				})
				msg := paymentMsg("m-copies", 3, 4)
				if earlier == "failed" {
					if err := deliver(h, msg); err == nil {
						t.Fatal("the failing copy was acked")
					}
				} else {
					fail = false
					crashedOnce(t, e, msg.UUID, "billing")
				}
				if n, _, _ := e.attemptsRow(msg.UUID); n != 1 {
					t.Fatalf("the earlier copy's record holds %d attempts, want 1", n)
				}
				if err := deliver(h, msg); err != nil { // the producer's second copy
					t.Fatal(err)
				}
				if b, r := e.balance(3), e.attemptRows(); b != 4 || r != 1 {
					t.Fatalf("after the second copy: balance %d, attempt rows %d; want 4, 1", b, r)
				}
				redelivered := msg.Copy()
				redelivered.Metadata.Set(redeliveredKey, "true")
				if err := deliver(h, redelivered); err != nil { // the earlier copy's redelivery
					t.Fatal(err)
				}
				if s := ib.Stats(); s.Processed != 1 || s.Duplicates != 1 || s.Isolated != 0 {
					t.Fatalf("stats %+v; want 1 processed, 1 duplicate, none isolated", s)
				}
				e.settled(dl, 3, 4)
			})
		}
	}
}
