package tests

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// dlWorld is the state every dead-letter test inspects: the business tables, the inbox tables
// and the queues.
type dlWorld struct {
	schema *testenv.Schema
	rabbit *rabbitAdmin
	queue  string
}

func (w *dlWorld) balance(t *testing.T, account int) int64 {
	return queryInt(t, w.schema.Pool, "SELECT balance FROM accounts WHERE id = $1", account)
}

func (w *dlWorld) inboxRows(t *testing.T, id string) int64 {
	return queryInt(t, w.schema.Pool, "SELECT count(*) FROM inbox_processed_messages WHERE message_id = $1", id)
}

func (w *dlWorld) runs(t *testing.T, id string) int64 {
	return queryInt(t, w.schema.Pool, "SELECT count(*) FROM dl_runs WHERE message_id = $1", id)
}

func (w *dlWorld) deliveries(t *testing.T, id string) int64 {
	return queryInt(t, w.schema.Pool, "SELECT count(*) FROM deliveries WHERE message_id = $1", id)
}

// assertInputSettled waits until nobody consumes the input queue and checks it is empty: a
// delivery left unacked by a stopped consumer would be ready again.
func (w *dlWorld) assertInputSettled(t *testing.T) {
	t.Helper()
	waitUntil(t, 10*time.Second, "the input queue to lose its consumer", func() (bool, string) {
		ready, consumers := w.rabbit.queueState(t, w.queue)
		return consumers == 0, fmt.Sprintf("ready=%d consumers=%d", ready, consumers)
	})
	if ready := w.rabbit.ready(t, w.queue); ready != 0 {
		t.Errorf("input queue holds %d messages after its consumer stopped, want 0 (a delivery was not acked)", ready)
	}
}

// checkDeadLetter checks a dead letter's identity, payload and the poison and inbox metadata.
func checkDeadLetter(t *testing.T, dl, orig *message.Message, topic string, reasonWants ...string) {
	t.Helper()
	if dl.UUID != orig.UUID || !bytes.Equal(dl.Payload, orig.Payload) {
		t.Errorf("dead letter is %s %s, want the original %s %s", dl.UUID, dl.Payload, orig.UUID, orig.Payload)
	}
	md := dl.Metadata
	reason := md.Get(wmmiddleware.ReasonForPoisonedKey)
	for _, want := range reasonWants {
		if !strings.Contains(reason, want) {
			t.Errorf("%s = %q, want it to mention %q", wmmiddleware.ReasonForPoisonedKey, reason, want)
		}
	}
	for key, want := range map[string]string{
		wmmiddleware.PoisonedTopicKey:      topic,
		wmmiddleware.PoisonedHandlerKey:    dlHandlerName,
		wmmiddleware.PoisonedSubscriberKey: "amqp.Subscriber",
		inbox.DeadLetterConsumerKey:        bankConsumerName,
		inbox.DeadLetterMessageKeyKey:      orig.UUID,
	} {
		if got := md.Get(key); got != want {
			t.Errorf("dead letter metadata %s = %q, want %q", key, got, want)
		}
	}
}

// TestDeadLetterPoisonAcrossCrashes runs a poison message (the handler always fails, after its
// UPDATE) with MaxAttempts 3 in child consumer processes on a RabbitMQ queue. The first two
// children SIGKILL themselves inside the handler; RabbitMQ redelivers to the next child. The
// durable attempt count survives the crashes: the third attempt is the last, the handler ran 3
// times in total, one dead letter lands on the RabbitMQ dead-letter queue and the original is
// acked. A re-publish of the same message is acked without running the handler; after
// Replay, the dead letter republished to the input queue runs the (fixed) handler once.
func TestDeadLetterPoisonAcrossCrashes(t *testing.T) {
	start := time.Now()
	const maxAttempts = 3
	crashRuns := []int{1, 2}
	w := &dlWorld{schema: testenv.NewSchema(t, 4), rabbit: newRabbitAdmin(t)}
	store := setupDeadLetterBank(t, w.schema, 1)
	w.queue = w.rabbit.newQueue(t)
	dlq := w.rabbit.newQueue(t)
	msg := paymentMsg(t, watermill.NewUUID(), 1, 7)
	id := msg.UUID
	w.rabbit.publish(t, w.queue, msg)

	var crash []string
	for _, r := range crashRuns {
		crash = append(crash, strconv.Itoa(r))
	}
	env := dlChildEnv{DeadLetterQueue: dlq, MaxAttempts: maxAttempts, CrashRuns: strings.Join(crash, ","), Handler: "fail"}
	var pids []int

	// Attempts 1 and 2: the process dies inside the handler.
	for _, run := range crashRuns {
		child := startDLChild(t, w.schema, w.rabbit.url, w.queue, env)
		pids = append(pids, child.Pid())
		if err := child.WaitExit(t, 20*time.Second); !testenv.KilledBySIGKILL(err) {
			t.Fatalf("child for run %d should have died of SIGKILL, got %v", run, err)
		}
		want := fmt.Sprintf("CRASH in-handler-run-%d %s", run, id)
		if line, ok := child.Find("CRASH "); !ok || line != want {
			t.Fatalf("child died without reaching the injected crash point: CRASH line %q, want %q", line, want)
		}
		waitUntil(t, 10*time.Second, "RabbitMQ to requeue the unacked delivery", func() (bool, string) {
			ready, consumers := w.rabbit.queueState(t, w.queue)
			return ready == 1 && consumers == 0, fmt.Sprintf("ready=%d consumers=%d", ready, consumers)
		})
		// Only the attempt count survived the crash.
		if a := readAttempts(t, w.schema.Pool, id); a.Attempts != run || a.DeadLettered {
			t.Fatalf("after the crash of run %d: attempts record %+v, want %d attempts, not dead-lettered", run, a, run)
		}
		if got := w.runs(t, id); got != int64(run) {
			t.Fatalf("after the crash of run %d: handler runs = %d", run, got)
		}
		if b, rows, dl := w.balance(t, 1), w.inboxRows(t, id), w.rabbit.ready(t, dlq); b != 0 || rows != 0 || dl != 0 {
			t.Fatalf("after the crash of run %d: balance %d, inbox rows %d, dead letters %d; want 0, 0, 0", run, b, rows, dl)
		}
	}

	// Attempt 3 = MaxAttempts: the handler fails without a crash, the inbox dead-letters.
	third := startDLChild(t, w.schema, w.rabbit.url, w.queue, env)
	pids = append(pids, third.Pid())
	waitUntil(t, 15*time.Second, "the dead letter", func() (bool, string) {
		n, a := w.rabbit.ready(t, dlq), readAttempts(t, w.schema.Pool, id)
		return n >= 1 && a.DeadLettered, fmt.Sprintf("dead-letter queue=%d attempts record=%+v", n, a)
	})
	if n := w.rabbit.ready(t, dlq); n != 1 {
		t.Fatalf("dead-letter queue holds %d messages, want 1", n)
	}
	dl, ok := w.rabbit.take(t, dlq)
	if !ok {
		t.Fatal("dead-letter queue emptied under us")
	}
	checkDeadLetter(t, dl, msg, w.queue, fmt.Sprintf("failed %d of %d attempts", maxAttempts, maxAttempts), errLedger.Error())
	if got := dl.Metadata.Get(inbox.DeadLetterAttemptsKey); got != strconv.Itoa(maxAttempts) {
		t.Errorf("dead letter %s = %q, want %d", inbox.DeadLetterAttemptsKey, got, maxAttempts)
	}

	// A later re-publish of the same message, to the same (third) consumer. With prefetch 1 its
	// delivery also shows the dead-lettered original was acked.
	w.rabbit.publish(t, w.queue, paymentMsg(t, id, 1, 7))
	waitUntil(t, 10*time.Second, "the re-published message's delivery", func() (bool, string) {
		d := w.deliveries(t, id)
		return d >= maxAttempts+1, fmt.Sprintf("deliveries=%d", d)
	})
	time.Sleep(ackGrace)
	if st := third.stopDL(t); st.DeadLettered != 1 || st.DeadLetteredSkips != 1 || st.Processed != 0 || st.Failed != 0 {
		t.Errorf("third consumer stats %+v, want deadlettered=1 dlskips=1 processed=0 failed=0", st)
	}
	w.assertInputSettled(t)

	// The handler ran exactly MaxAttempts times, once per process, on attempts 1, 2, 3.
	rows, err := w.schema.Pool.Query(t.Context(), "SELECT pid, inbox_attempt FROM dl_runs WHERE message_id = $1 ORDER BY id", id)
	if err != nil {
		t.Fatal(err)
	}
	var gotRuns []string
	for rows.Next() {
		var pid, attempt int
		if err := rows.Scan(&pid, &attempt); err != nil {
			t.Fatal(err)
		}
		gotRuns = append(gotRuns, fmt.Sprintf("pid %d attempt %d", pid, attempt))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	var wantRuns []string
	for i, pid := range pids {
		wantRuns = append(wantRuns, fmt.Sprintf("pid %d attempt %d", pid, i+1))
	}
	if !slices.Equal(gotRuns, wantRuns) {
		t.Errorf("handler runs = %q, want %q (MaxAttempts=%d across crashes)", gotRuns, wantRuns, maxAttempts)
	}
	a := readAttempts(t, w.schema.Pool, id)
	if !a.DeadLettered || !strings.Contains(a.LastError, errLedger.Error()) || !strings.Contains(a.Reason, "failed 3 of 3 attempts") {
		t.Errorf("attempts record %+v, want dead-lettered with the ledger error", a)
	}
	if b, r, n := w.balance(t, 1), w.inboxRows(t, id), w.rabbit.ready(t, dlq); b != 0 || r != 0 || n != 0 {
		t.Errorf("after dead-lettering: balance %d, inbox rows %d, further dead letters %d; want 0, 0, 0", b, r, n)
	}

	// Replay, then republish the dead letter to the input queue, to a consumer whose handler
	// was fixed: the handler runs again, once, and commits.
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: bankConsumerName}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if replayed, err := ib.Replay(ctx, id); err != nil || !replayed {
		t.Fatalf("Replay = %v, %v; want true", replayed, err)
	}
	if a := readAttempts(t, w.schema.Pool, id); a.Exists {
		t.Fatalf("attempts record after Replay: %+v", a)
	}
	fixed := startDLChild(t, w.schema, w.rabbit.url, w.queue, dlChildEnv{DeadLetterQueue: dlq, MaxAttempts: maxAttempts, Handler: "ok"})
	w.rabbit.publish(t, w.queue, dl)
	waitUntil(t, 10*time.Second, "the replayed message to be processed", func() (bool, string) {
		r := w.inboxRows(t, id)
		return r >= 1, fmt.Sprintf("inbox rows=%d", r)
	})
	time.Sleep(ackGrace)
	if st := fixed.stopDL(t); st.Processed != 1 || st.DeadLettered != 0 || st.DeadLetteredSkips != 0 || st.Failed != 0 {
		t.Errorf("replay consumer stats %+v, want processed=1 and nothing else", st)
	}
	w.assertInputSettled(t)
	if r := w.runs(t, id); r != maxAttempts+1 {
		t.Errorf("handler runs after the replay = %d, want %d", r, maxAttempts+1)
	}
	if last := queryInt(t, w.schema.Pool, "SELECT inbox_attempt FROM dl_runs WHERE message_id = $1 ORDER BY id DESC LIMIT 1", id); last != 1 {
		t.Errorf("the replayed run was attempt %d, want 1 (Replay resets the count)", last)
	}
	if b, r, n := w.balance(t, 1), w.inboxRows(t, id), w.rabbit.ready(t, dlq); b != 7 || r != 1 || n != 0 {
		t.Errorf("after the replay: balance %d, inbox rows %d, dead letters %d; want 7, 1, 0", b, r, n)
	}
	if a := readAttempts(t, w.schema.Pool, id); a.Exists {
		t.Errorf("the successful replay left an attempts record: %+v", a)
	}
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}

// TestDeadLetterPublishFailureNacksUntilRecovered makes the dead-letter publish fail on the
// broker: the dead-letter queue is full (x-max-length 1, x-overflow reject-publish, holding a
// plug message), so RabbitMQ nacks the publisher confirm and watermill-amqp's Publish returns
// an error. With MaxAttempts 1 the inbox must nack the original, which keeps coming back, and
// must not mark it dead-lettered. Once the plug is consumed (the publisher recovers) exactly
// one dead letter arrives and the original is acked.
func TestDeadLetterPublishFailureNacksUntilRecovered(t *testing.T) {
	start := time.Now()
	w := &dlWorld{schema: testenv.NewSchema(t, 4), rabbit: newRabbitAdmin(t)}
	setupDeadLetterBank(t, w.schema, 1)
	w.queue = w.rabbit.newQueue(t)
	dlqArgs := map[string]any{"x-max-length": int32(1), "x-overflow": "reject-publish"}
	dlq := w.rabbit.newQueueWithArgs(t, dlqArgs)
	plug := message.NewMessage("plug-"+watermill.NewUUID(), []byte("plug"))
	w.rabbit.publish(t, dlq, plug)
	if err := w.rabbit.pub.Publish(dlq, message.NewMessage(watermill.NewUUID(), []byte("probe"))); err == nil {
		t.Fatal("a publish to the full dead-letter queue succeeded: the outage is not real")
	}

	pool := testenv.NewPool(t, w.schema.URL, 4)
	logger := &countingLogger{}
	c := startDLConsumer(t, dlConsumerConfig{
		consumerConfig: consumerConfig{
			Pool: pool, Schema: w.schema.Name, AMQPURL: w.rabbit.url, Queue: w.queue,
			Logger: logger, RecordDeliveries: true,
			AfterUpdate: func(msg *message.Message) error {
				if _, err := recordRun(pool, msg); err != nil {
					return err
				}
				return errLedger
			},
		},
		DeadLetterQueue:     dlq,
		DeadLetterQueueArgs: dlqArgs,
		MaxAttempts:         1,
	})
	msg := paymentMsg(t, watermill.NewUUID(), 1, 5)
	id := msg.UUID
	w.rabbit.publish(t, w.queue, msg)

	// The outage: every delivery is nacked and RabbitMQ redelivers it.
	const outageDeliveries = 4
	waitUntil(t, 10*time.Second, "redeliveries while the dead-letter queue is full", func() (bool, string) {
		d := w.deliveries(t, id)
		return d >= outageDeliveries, fmt.Sprintf("deliveries=%d", d)
	})
	d := w.deliveries(t, id)
	a := readAttempts(t, w.schema.Pool, id)
	// Only the delivery that ran the handler counts: the later ones found the attempts used
	// up and only retried the dead letter.
	if a.DeadLettered || a.Attempts != 1 {
		t.Errorf("during the outage, after %d deliveries: attempts record %+v, want 1 attempt (the one handler run), not dead-lettered", d, a)
	}
	if re := queryInt(t, w.schema.Pool, "SELECT count(*) FROM deliveries WHERE message_id = $1 AND redelivered", id); re < d-1 {
		t.Errorf("%d of %d deliveries flagged redelivered, want all but the first: the message was not nacked", re, d)
	}
	if st := c.Inbox.Stats(); st.DeadLettered != 0 || st.Processed != 0 {
		t.Errorf("stats during the outage %+v, want nothing dead-lettered or processed", st)
	}
	if s := c.Succeeded.Load(); s != 0 {
		t.Errorf("%d deliveries acked during the outage, want 0", s)
	}
	if r := w.runs(t, id); r != 1 {
		t.Errorf("handler runs during the outage = %d, want 1 (later deliveries exceed MaxAttempts and only retry the dead letter)", r)
	}
	if n := w.rabbit.ready(t, dlq); n != 1 {
		t.Errorf("dead-letter queue holds %d messages during the outage, want 1 (the plug)", n)
	}
	if !strings.Contains(logger.summary(), "delivery not confirmed") {
		t.Errorf("the failed dead-letter publish was not logged as the broker's refusal: %s", logger.summary())
	}

	// Recovery: consume the plug, so the queue has room for one message.
	if got, ok := w.rabbit.take(t, dlq); !ok || got.UUID != plug.UUID {
		t.Fatalf("took %v from the dead-letter queue, want the plug %s", got, plug.UUID)
	}
	waitUntil(t, 10*time.Second, "the dead letter after the recovery", func() (bool, string) {
		n, st := w.rabbit.ready(t, dlq), c.Inbox.Stats()
		return n >= 1 && st.DeadLettered >= 1 && c.Succeeded.Load() >= 1,
			fmt.Sprintf("dead-letter queue=%d dead-lettered=%d acked=%d", n, st.DeadLettered, c.Succeeded.Load())
	})
	time.Sleep(ackGrace)
	// Room again: a second dead letter, if one were published, would land now.
	dl, ok := w.rabbit.take(t, dlq)
	if !ok {
		t.Fatal("dead-letter queue emptied under us")
	}
	time.Sleep(ackGrace)
	if err := c.Close(); err != nil {
		t.Fatalf("close consumer: %v", err)
	}
	w.assertInputSettled(t)

	a = readAttempts(t, w.schema.Pool, id)
	checkDeadLetter(t, dl, msg, w.queue, "attempts")
	if got := dl.Metadata.Get(inbox.DeadLetterAttemptsKey); got != strconv.Itoa(a.Attempts) {
		t.Errorf("dead letter %s = %q, want the recorded %d", inbox.DeadLetterAttemptsKey, got, a.Attempts)
	}
	if !a.DeadLettered {
		t.Errorf("attempts record after the recovery %+v, want dead-lettered", a)
	}
	st := c.Inbox.Stats()
	total := w.deliveries(t, id)
	if st.DeadLettered != 1 || st.Processed != 0 || st.Failed != uint64(total-1) || c.Succeeded.Load() != 1 {
		t.Errorf("stats %+v, acked %d, after %d deliveries; want deadlettered=1, failed=%d, acked 1", st, c.Succeeded.Load(), total, total-1)
	}
	if n := w.rabbit.ready(t, dlq); n != 0 {
		t.Errorf("%d further dead letters, want exactly one in total", n)
	}
	if r, b, rows := w.runs(t, id), w.balance(t, 1), w.inboxRows(t, id); r != 1 || b != 0 || rows != 0 {
		t.Errorf("handler runs %d, balance %d, inbox rows %d; want 1, 0, 0", r, b, rows)
	}
	t.Logf("%d deliveries, %d during the outage; took %s", total, d, time.Since(start).Round(time.Millisecond))
}

// TestDeadLetterKeyCollision publishes two different payloads with the same message UUID to a
// RabbitMQ queue (another producer reused the ID), then a true duplicate of the first. The
// first's effect stands alone; the second ends on the dead-letter queue with a collision
// reason and is acked; the duplicate is acked without running the handler.
func TestDeadLetterKeyCollision(t *testing.T) {
	start := time.Now()
	w := &dlWorld{schema: testenv.NewSchema(t, 4), rabbit: newRabbitAdmin(t)}
	setupDeadLetterBank(t, w.schema, 2)
	w.queue = w.rabbit.newQueue(t)
	dlq := w.rabbit.newQueue(t)
	pool := testenv.NewPool(t, w.schema.URL, 4)
	c := startDLConsumer(t, dlConsumerConfig{
		consumerConfig: consumerConfig{
			Pool: pool, Schema: w.schema.Name, AMQPURL: w.rabbit.url, Queue: w.queue,
			Logger: &countingLogger{}, RecordDeliveries: true,
			AfterUpdate: func(msg *message.Message) error {
				_, err := recordRun(pool, msg)
				return err
			},
		},
		DeadLetterQueue: dlq,
	})

	id := watermill.NewUUID()
	first := paymentMsg(t, id, 1, 100)
	second := paymentMsg(t, id, 2, 999)
	w.rabbit.publish(t, w.queue, first)
	waitUntil(t, 10*time.Second, "the first message to be processed", func() (bool, string) {
		r := w.inboxRows(t, id)
		return r >= 1, fmt.Sprintf("inbox rows=%d", r)
	})
	w.rabbit.publish(t, w.queue, second)
	waitUntil(t, 10*time.Second, "the colliding message's dead letter", func() (bool, string) {
		n := w.rabbit.ready(t, dlq)
		return n >= 1, fmt.Sprintf("dead-letter queue=%d", n)
	})
	w.rabbit.publish(t, w.queue, paymentMsg(t, id, 1, 100)) // a true duplicate of the first
	waitUntil(t, 10*time.Second, "all three deliveries to be acked", func() (bool, string) {
		d, s := w.deliveries(t, id), c.Succeeded.Load()
		return d >= 3 && s >= 3, fmt.Sprintf("deliveries=%d acked=%d", d, s)
	})
	time.Sleep(ackGrace)
	if err := c.Close(); err != nil {
		t.Fatalf("close consumer: %v", err)
	}
	w.assertInputSettled(t)

	if b1, b2 := w.balance(t, 1), w.balance(t, 2); b1 != 100 || b2 != 0 {
		t.Errorf("balances %d, %d; want 100, 0 (the first message's effect alone)", b1, b2)
	}
	if r, rows, d := w.runs(t, id), w.inboxRows(t, id), w.deliveries(t, id); r != 1 || rows != 1 || d != 3 {
		t.Errorf("handler runs %d, inbox rows %d, deliveries %d; want 1, 1, 3", r, rows, d)
	}
	var hash []byte
	if err := w.schema.Pool.QueryRow(t.Context(), "SELECT payload_hash FROM inbox_processed_messages WHERE message_id = $1", id).Scan(&hash); err != nil {
		t.Fatal(err)
	}
	if sum := sha256.Sum256(first.Payload); !bytes.Equal(hash, sum[:]) {
		t.Errorf("stored payload hash %x is not the first payload's %x", hash, sum)
	}
	if n := w.rabbit.ready(t, dlq); n != 1 {
		t.Fatalf("dead-letter queue holds %d messages, want 1", n)
	}
	dl, _ := w.rabbit.take(t, dlq)
	checkDeadLetter(t, dl, second, w.queue, "collision")
	if a := readAttempts(t, w.schema.Pool, id); a.Exists {
		t.Errorf("attempts record %+v: a collision must not mark the processed key dead-lettered", a)
	}
	if st := c.Inbox.Stats(); st.Processed != 1 || st.Collisions != 1 || st.Duplicates != 1 || st.DeadLettered != 1 || st.DeadLetteredSkips != 0 || st.Failed != 0 {
		t.Errorf("stats %+v, want processed=1 collisions=1 duplicates=1 deadlettered=1", st)
	}
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}
