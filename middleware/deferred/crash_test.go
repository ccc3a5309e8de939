package deferred_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	natsgo "github.com/nats-io/nats.go"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/nats"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// The child process's settings (environment).
const (
	envChild   = "DEFERRED_CHILD"       // "workers" or "receiver"
	envDB      = "DEFERRED_DB"          // the schema's URL
	envSchema  = "DEFERRED_SCHEMA"      // the schema
	envKillAt  = "DEFERRED_KILL_AT"     // workers: SIGKILL inside the handler of the N-th row
	envPoison  = "DEFERRED_POISON_KILL" // workers: SIGKILL inside the handler of key "poison"
	envKillKey = "DEFERRED_KILL_KEY"    // receiver: SIGKILL after this key's receipt committed, before its ack
	envTopic   = "DEFERRED_TOPIC"       // receiver: the NATS topic
	envGroup   = "DEFERRED_GROUP"       // receiver: the NATS consumer group
)

// childLease is the lease of the crash tests: a killed worker's rows come back after it.
const childLease = 2 * time.Second

// TestDeferredChild is the child process of the crash tests; it returns at once unless started
// by one (DEFERRED_CHILD set), as the child entries in tests/ do.
func TestDeferredChild(t *testing.T) {
	mode := os.Getenv(envChild)
	if mode == "" {
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	pool := testenv.NewPool(t, os.Getenv(envDB), 4)
	cfg := deferred.Config{Pool: pool, Schema: os.Getenv(envSchema), ConsumerName: "billing", Workers: 2,
		Lease: childLease, ReapInterval: 200 * time.Millisecond, PollInterval: 100 * time.Millisecond}
	ib, err := deferred.New(cfg, testLogger)
	if err != nil {
		t.Fatal(err)
	}
	switch mode {
	case "workers":
		killAt, _ := strconv.Atoi(os.Getenv(envKillAt))
		var handled atomic.Int64
		w := ib.NewConsumerWorkers(func(msg *message.Message) error {
			if err := creditWithEffect(msg); err != nil {
				return err
			}
			if msg.UUID == "poison" && os.Getenv(envPoison) == "1" || killAt > 0 && handled.Add(1) == int64(killAt) {
				fmt.Println("KILLING", msg.UUID)
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL) // mid-batch, the row's transaction open
				select {}
			}
			return nil
		})
		go func() { _ = w.Run(ctx) }()
		<-w.Running()
		fmt.Println("READY")
		// A child stops by itself before inboxtest's ChildMaxLifetime; the parent starts
		// another while rows remain (a slow, shared machine).
		lctx, lcancel := context.WithTimeout(ctx, testenv.ChildMaxLifetime-15*time.Second)
		defer lcancel()
		testenv.WaitChildStop(t, lctx, "deferred workers child")
		_ = w.Close()
		fmt.Println("STOPPED")
	case "receiver":
		b := natsBroker(t, os.Getenv(envGroup), 2*time.Second)
		msgs, err := b.Subscriber.Subscribe(ctx, os.Getenv(envTopic))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Println("READY")
		go func() {
			for msg := range msgs {
				before := ib.Counters().Duplicates
				if err := ib.Receive(msg); err != nil {
					msg.Nack()
					continue
				}
				if ib.Counters().Duplicates > before {
					fmt.Println("DUPLICATE", msg.UUID)
				}
				if msg.UUID == os.Getenv(envKillKey) {
					fmt.Println("KILLING", msg.UUID)
					_ = syscall.Kill(os.Getpid(), syscall.SIGKILL) // committed, not acked
					select {}
				}
				msg.Ack()
			}
		}()
		testenv.WaitChildStop(t, ctx, "deferred receiver child")
	}
}

// creditWithEffect credits the payment and records the effect (one row per run that
// commits), in the row's transaction.
func creditWithEffect(msg *message.Message) error {
	if err := credit(msg); err != nil {
		return err
	}
	tx, _ := pgstore.TxFromContext(msg.Context())
	_, err := tx.Exec(msg.Context(), "INSERT INTO effects (message_id, pid) VALUES ($1, $2)", msg.UUID, os.Getpid())
	return err
}

func childEnv(s *testenv.Schema, mode string, extra ...string) []string {
	return append([]string{envChild + "=" + mode, envDB + "=" + childURL(s), envSchema + "=" + s.Name}, extra...)
}

// childURL is the schema's URL with synchronous_commit off for the child's sessions: a commit
// returns before its WAL record is flushed to disk. The crash tests kill client processes,
// never the server, and what one session committed is visible to the others at once either
// way; the children's thousands of commits no longer each wait for an fsync on the shared
// machine's disk.
func childURL(s *testenv.Schema) string {
	u, err := url.Parse(s.URL)
	if err != nil {
		return s.URL
	}
	q := u.Query()
	q.Set("synchronous_commit", "off")
	u.RawQuery = q.Encode()
	return u.String()
}

// TestWorkersCrashMidBatch: 10,000 rows, four workers in two processes; one process is
// SIGKILLed inside a handler in the middle of a batch, then restarted. Every row ends done
// exactly once: one committed effect per row, and every balance exact.
func TestWorkersCrashMidBatch(t *testing.T) {
	const rows, accounts = 10000, 100
	ib, s := newInbox(t, deferred.Config{Lease: childLease}, accounts)
	s.Exec(t, "CREATE TABLE effects (message_id text NOT NULL, pid int NOT NULL)")
	// Stored in one statement, as receipts would have stored them.
	s.Exec(t, `INSERT INTO inbox_deferred (message_id, consumer_name, message_uuid, payload, payload_hash, metadata)
		SELECT 'm-' || g, 'billing', 'm-' || g, p, sha256(p), '{}'
		FROM generate_series(1, $1::int) g,
		     LATERAL (SELECT convert_to(json_build_object('account', g % $2::int + 1, 'amount', 1)::text, 'UTF8') AS p) x`, rows, accounts)
	victim := testenv.StartChild(t, "TestDeferredChild", childEnv(s, "workers", envKillAt+"=1525"))
	survivor := testenv.StartChild(t, "TestDeferredChild", childEnv(s, "workers"))
	victim.WaitLine(t, "READY", 30*time.Second)
	survivor.WaitLine(t, "READY", 30*time.Second)
	if err := victim.WaitExit(t, 120*time.Second); !testenv.KilledBySIGKILL(err) {
		t.Fatalf("the victim exited with %v, want SIGKILL", err)
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'"); n >= rows {
		t.Fatalf("all %d rows done before the victim died: the kill was not mid-run", n)
	}
	// The killed process is restarted, as its supervisor would: four workers in two processes
	// again. Its claimed rows come back only through the reaper, after the lease.
	restarted := testenv.StartChild(t, "TestDeferredChild", childEnv(s, "workers"))
	deadline := time.Now().Add(5 * time.Minute)
	for count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") < rows {
		if time.Now().After(deadline) {
			t.Fatalf("rows not done after 5 minutes")
		}
		if _, stopped := survivor.Find("STOPPED"); stopped {
			_ = survivor.WaitExit(t, 30*time.Second)
			survivor = testenv.StartChild(t, "TestDeferredChild", childEnv(s, "workers"))
		}
		if _, stopped := restarted.Find("STOPPED"); stopped {
			_ = restarted.WaitExit(t, 30*time.Second)
			restarted = testenv.StartChild(t, "TestDeferredChild", childEnv(s, "workers"))
		}
		time.Sleep(100 * time.Millisecond)
	}
	survivor.Stop(t, "")
	restarted.Stop(t, "")
	if n := count(t, s.Pool, "SELECT count(*) FROM effects"); n != rows {
		t.Fatalf("%d effects committed, want %d", n, rows)
	}
	if n := count(t, s.Pool, "SELECT count(DISTINCT message_id) FROM effects"); n != rows {
		t.Fatalf("%d distinct messages with effects, want %d", n, rows)
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM accounts WHERE balance <> $1", rows/accounts); n != 0 {
		t.Fatalf("%d balances wrong", n)
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE attempts >= 2"); n < 1 {
		t.Fatalf("no row counts the killed run as an attempt")
	}
	_ = ib
}

// TestPoisonAcrossCrash: a poison message crashes its worker process (SIGKILL in the handler),
// then fails twice more in another worker: dead after MaxAttempts = 3 runs in all, published
// to the dead-letter topic, the healthy message done; a replay runs it once more.
func TestPoisonAcrossCrash(t *testing.T) {
	dlq := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = dlq.Close() })
	letters, err := dlq.Subscribe(context.Background(), "dead")
	if err != nil {
		t.Fatal(err)
	}
	cfg := deferred.Config{Lease: childLease, ReapInterval: 200 * time.Millisecond, MaxAttempts: 3, Backoff: 10 * time.Millisecond,
		DeadLetterPublisher: dlq, DeadLetterTopic: "dead", Workers: 1}
	ib, s := newInbox(t, cfg, 1)
	s.Exec(t, "CREATE TABLE effects (message_id text NOT NULL, pid int NOT NULL)")
	for _, id := range []string{"poison", "healthy"} {
		m := payment(id, 1, 10, 0)
		m.Metadata = message.Metadata{}
		if err := ib.Receive(m); err != nil {
			t.Fatal(err)
		}
	}
	child := testenv.StartChild(t, "TestDeferredChild", childEnv(s, "workers", envPoison+"=1"))
	if err := child.WaitExit(t, 60*time.Second); !testenv.KilledBySIGKILL(err) {
		t.Fatalf("the child exited with %v, want SIGKILL", err)
	}
	var fixed atomic.Bool
	var runs atomic.Int64
	h := func(msg *message.Message) error {
		if msg.UUID == "poison" {
			runs.Add(1)
			if !fixed.Load() {
				return fmt.Errorf("cannot handle this payment")
			}
		}
		return creditWithEffect(msg)
	}
	runWorkers(t, ib.NewConsumerWorkers(h))
	var dl *message.Message
	select {
	case dl = <-letters:
		dl.Ack()
	case <-time.After(30 * time.Second):
		t.Fatal("no dead letter")
	}
	if got := dl.Metadata.Get(inbox.DeadLetterAttemptsKey); got != "3" || dl.UUID != "poison" {
		t.Fatalf("dead letter %s with %s attempts, want poison with 3", dl.UUID, got)
	}
	// The dead letter is published first, then the row marked dead.
	waitFor(t, 10*time.Second, "the poison row dead", func() bool {
		r, _ := ib.Get(context.Background(), "poison")
		return r.Status == deferred.StatusDead
	})
	row, err := ib.Get(context.Background(), "poison")
	if err != nil || row.Status != deferred.StatusDead || row.Attempts != 3 || runs.Load() != 2 {
		t.Fatalf("poison row %+v (%v), %d runs here; want dead after 3 attempts, 2 of them here", row, err, runs.Load())
	}
	waitFor(t, 10*time.Second, "the healthy row done", func() bool {
		r, _ := ib.Get(context.Background(), "healthy")
		return r.Status == deferred.StatusDone
	})
	fixed.Store(true)
	if n, err := ib.Replay(context.Background(), deferred.ReplayParams{Statuses: []deferred.Status{deferred.StatusDead}}); err != nil || n != 1 {
		t.Fatalf("replay: %d %v", n, err)
	}
	waitFor(t, 10*time.Second, "the replayed row done", func() bool {
		r, _ := ib.Get(context.Background(), "poison")
		return r.Status == deferred.StatusDone
	})
	time.Sleep(200 * time.Millisecond)
	if runs.Load() != 3 {
		t.Fatalf("handler ran %d times for poison, want 2 + 1 after the replay", runs.Load())
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM effects WHERE message_id = 'poison'"); n != 1 {
		t.Fatalf("%d effects of poison, want 1", n)
	}
	if b := count(t, s.Pool, "SELECT balance FROM accounts WHERE id = 1"); b != 20 {
		t.Fatalf("balance %d, want 20", b)
	}
}

// natsBroker connects to the machine's NATS JetStream with consumer group group.
func natsBroker(t testing.TB, group string, ackWait time.Duration) *adapters.Broker {
	t.Helper()
	b, err := nats.New(nats.Config{URL: testenv.RequireNATS(t), ConsumerGroup: group, AckWait: ackWait,
		Stream: natsgo.StreamConfig{MaxAge: time.Hour}}, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("nats: %v", err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

// deleteStream removes a test's stream.
func deleteStream(t testing.TB, topic string) {
	nc, err := natsgo.Connect(testenv.NATSURL())
	if err != nil {
		return
	}
	defer nc.Close()
	if js, err := nc.JetStream(); err == nil {
		_ = js.DeleteStream(topic)
	}
}

func uniqueName(prefix string) string {
	return fmt.Sprintf("%s_%d_%d", prefix, os.Getpid(), time.Now().UnixNano())
}

// TestReceiptCrashBetweenCommitAndAck (NATS JetStream): the receiver is SIGKILLed after a
// receipt committed and before its ack; restarted, it gets the broker's redelivery after
// AckWait and acks it as a duplicate. One row per message; each credited once.
func TestReceiptCrashBetweenCommitAndAck(t *testing.T) {
	ib, s := newInbox(t, deferred.Config{}, 1)
	topic, group := uniqueName("deferred_receipt"), uniqueName("g")
	pub := natsBroker(t, group, 2*time.Second)
	if err := pub.Subscriber.(message.SubscribeInitializer).SubscribeInitialize(topic); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deleteStream(t, topic) })
	env := []string{envTopic + "=" + topic, envGroup + "=" + group}
	child := testenv.StartChild(t, "TestDeferredChild", childEnv(s, "receiver", append(env, envKillKey+"=r-2")...))
	child.WaitLine(t, "READY", 30*time.Second)
	for k := range 5 {
		if err := pub.Publisher.Publish(topic, payment("r-"+strconv.Itoa(k), 1, 100, 0)); err != nil {
			t.Fatal(err)
		}
	}
	if err := child.WaitExit(t, 30*time.Second); !testenv.KilledBySIGKILL(err) {
		t.Fatalf("the receiver exited with %v, want SIGKILL", err)
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE message_id = 'r-2'"); n != 1 {
		t.Fatalf("the killed receipt did not commit (%d rows)", n)
	}
	again := testenv.StartChild(t, "TestDeferredChild", childEnv(s, "receiver", env...))
	again.WaitLine(t, "DUPLICATE r-2", 30*time.Second)
	waitFor(t, 30*time.Second, "five rows", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred") == 5
	})
	again.Stop(t, "")
	runWorkers(t, ib.NewConsumerWorkers(credit))
	waitFor(t, 20*time.Second, "five rows done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 5
	})
	if b := count(t, s.Pool, "SELECT balance FROM accounts WHERE id = 1"); b != 500 {
		t.Fatalf("balance %d, want 500", b)
	}
}

// TestSlowHandlerPastAckWait (NATS JetStream): handlers three times slower than AckWait. The
// receipt acks at once, so the broker never redelivers (no duplicate receipt) and each
// handler runs once.
func TestSlowHandlerPastAckWait(t *testing.T) {
	const ackWait = time.Second
	ib, s := newInbox(t, deferred.Config{Workers: 3}, 1)
	topic, group := uniqueName("deferred_slow"), uniqueName("g")
	b := natsBroker(t, group, ackWait)
	t.Cleanup(func() { deleteStream(t, topic) })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := b.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for msg := range msgs {
			if err := ib.Receive(msg); err != nil {
				msg.Nack()
				continue
			}
			msg.Ack()
		}
	}()
	var mu sync.Mutex
	runs := map[string]int{}
	runWorkers(t, ib.NewConsumerWorkers(func(msg *message.Message) error {
		mu.Lock()
		runs[msg.UUID]++
		mu.Unlock()
		time.Sleep(3 * ackWait)
		return credit(msg)
	}))
	for k := range 3 {
		if err := b.Publisher.Publish(topic, payment("slow-"+strconv.Itoa(k), 1, 100, 0)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 30*time.Second, "three rows done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 3
	})
	time.Sleep(2 * ackWait) // a redelivery would have arrived by now
	mu.Lock()
	defer mu.Unlock()
	for id, n := range runs {
		if n != 1 {
			t.Fatalf("%s ran %d times", id, n)
		}
	}
	if c := ib.Counters(); c.Received != 3 || c.Duplicates != 0 || len(runs) != 3 {
		t.Fatalf("counters %+v, runs %v: want 3 receipts, no redelivery", c, runs)
	}
	if bal := count(t, s.Pool, "SELECT balance FROM accounts WHERE id = 1"); bal != 300 {
		t.Fatalf("balance %d, want 300", bal)
	}
}
