package tests

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

// TestFailedAttemptRedelivered makes the handler fail the first attempt of some messages
// after its UPDATE. The inbox rolls back (claim and update), the router nacks, RabbitMQ
// requeues, and the redelivery runs the handler again and commits: the failed attempt left no
// processed mark, and every payment is applied exactly once.
func TestFailedAttemptRedelivered(t *testing.T) {
	start := time.Now()
	schema := testenv.NewSchema(t, 4)
	rabbit := newRabbitAdmin(t)
	store := setupBank(t, schema, 2)
	queue := rabbit.newQueue(t)

	const n = 6
	var msgs []*message.Message
	failFirst := map[string]bool{}
	want := map[int]int64{}
	for i := 0; i < n; i++ {
		account, amount := i%2+1, int64(1)<<(4*i) // distinct hex digits per message
		m := paymentMsg(t, watermill.NewUUID(), account, amount)
		msgs = append(msgs, m)
		want[account] += amount
		if i%2 == 0 {
			failFirst[m.UUID] = true
		}
	}

	pool := testenv.NewPool(t, schema.URL, 4) // the inbox transaction + an autocommit connection
	// attempt counts this message's handler runs durably, on an autocommit connection.
	attempt := func(msg *message.Message) (int64, error) {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(msg.Context()), 5*time.Second)
		defer cancel()
		var a int64
		err := pool.QueryRow(ctx, `INSERT INTO attempts (message_id, n) VALUES ($1, 1)
			ON CONFLICT (message_id) DO UPDATE SET n = attempts.n + 1 RETURNING n`, msg.UUID).Scan(&a)
		return a, err
	}
	errInjected := errors.New("injected failure on the first attempt")
	c := startConsumer(t, consumerConfig{
		Pool:             pool,
		Schema:           schema.Name,
		AMQPURL:          rabbit.url,
		Queue:            queue,
		RecordDeliveries: true,
		RecordRuns:       true,
		AfterUpdate: func(msg *message.Message) error {
			a, err := attempt(msg)
			if err != nil {
				return fmt.Errorf("count attempt: %w", err)
			}
			if failFirst[msg.UUID] && a == 1 {
				return errInjected // after the UPDATE: the rollback must undo it
			}
			return nil
		},
	})

	rabbit.publish(t, queue, msgs...)
	waitUntil(t, 20*time.Second, "every message to be processed", func() (bool, string) {
		ok := c.Succeeded.Load()
		rows := queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table())
		return ok >= n && rows >= n, fmt.Sprintf("succeeded=%d inbox rows=%d", ok, rows)
	})
	time.Sleep(ackGrace)
	if err := c.Close(); err != nil {
		t.Fatalf("close consumer: %v", err)
	}

	for account, w := range want {
		if got := queryInt(t, schema.Pool, "SELECT balance FROM accounts WHERE id = $1", account); got != w {
			t.Errorf("account %d balance = %#x, want %#x (each payment exactly once)", account, got, w)
		}
	}
	if got := queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table()); got != n {
		t.Errorf("inbox rows = %d, want %d", got, n)
	}
	for _, m := range msgs {
		wantRuns, wantDeliveries := int64(1), int64(1)
		if failFirst[m.UUID] {
			wantRuns, wantDeliveries = 2, 2
		}
		if got := queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table()+" WHERE message_id = $1", m.UUID); got != 1 {
			t.Errorf("inbox rows for %s = %d, want 1", m.UUID, got)
		}
		if got := queryInt(t, schema.Pool, "SELECT n FROM attempts WHERE message_id = $1", m.UUID); got != wantRuns {
			t.Errorf("attempts of %s (fail first: %v) = %d, want %d", m.UUID, failFirst[m.UUID], got, wantRuns)
		}
		if got := queryInt(t, schema.Pool, "SELECT count(*) FROM handler_runs WHERE message_id = $1", m.UUID); got != wantRuns {
			t.Errorf("handler runs of %s = %d, want %d", m.UUID, got, wantRuns)
		}
		if got := queryInt(t, schema.Pool, "SELECT count(*) FROM deliveries WHERE message_id = $1", m.UUID); got != wantDeliveries {
			t.Errorf("deliveries of %s = %d, want %d", m.UUID, got, wantDeliveries)
		}
		// The second delivery is RabbitMQ's requeue of the nacked one, not a new publish.
		if failFirst[m.UUID] {
			if got := queryInt(t, schema.Pool, "SELECT count(*) FROM deliveries WHERE message_id = $1 AND redelivered", m.UUID); got != 1 {
				t.Errorf("redeliveries of %s = %d, want 1", m.UUID, got)
			}
		}
	}
	if st := c.Inbox.Stats(); st.Processed != n || st.Failed != uint64(len(failFirst)) || st.Duplicates != 0 {
		t.Errorf("stats = %+v, want processed=%d failed=%d duplicates=0", st, n, len(failFirst))
	}
	if got := c.Succeeded.Load(); got != n {
		t.Errorf("acked deliveries = %d, want %d", got, n)
	}
	if ready, consumers := rabbit.queueState(t, queue); ready != 0 || consumers != 0 {
		t.Errorf("queue after the consumer stopped: ready=%d consumers=%d, want 0 and 0", ready, consumers)
	}
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}
