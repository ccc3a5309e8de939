// Package adaptertest is the guarantee matrix every broker adapter must pass, against the real
// broker and the real PostgreSQL: a sequential duplicate, a concurrent duplicate, a crash
// between commit and ack (a child process killed with SIGKILL, restarted, and the broker's own
// redelivery), and a poison message that ends on the dead-letter topic.
//
// An adapter's test package runs it with two functions:
//
//	func TestGuarantees(t *testing.T) { adaptertest.Run(t, harness) }
//	func TestAdapterChild(t *testing.T) { adaptertest.Child(t, harness) } // the crash child
//
// The matrix needs PostgreSQL (INBOX_DATABASE_URL) and the broker. It follows package
// inboxtest's rule: under go test -short it skips; otherwise a missing PostgreSQL fails it.
// It imports nothing internal to this repository, so an adapter in another module can run it.
package adaptertest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/inboxtest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// Harness describes one broker.
type Harness struct {
	// NewBroker connects to the broker. group is the consumer group (queue group, durable
	// name) subscribers must share; pool is the test's database (the postgres broker uses
	// it). It is called in the test process and, with the same environment, in the child.
	NewBroker func(pool *pgxpool.Pool, group string) (*adapters.Broker, error)
	// Env is extra environment the child process needs to reach the broker (addresses of an
	// in-process cluster), as KEY=VALUE.
	Env []string
	// ChildTest names the test function that calls Child. Default: "TestAdapterChild".
	ChildTest string
	// Timeout bounds each wait for the broker. Default: 30 s.
	Timeout time.Duration
}

const (
	envChild = "ADAPTERTEST_CHILD"
	envDB    = "ADAPTERTEST_DATABASE_URL"
	envSch   = "ADAPTERTEST_SCHEMA"
	envTopic = "ADAPTERTEST_TOPIC"
	envGroup = "ADAPTERTEST_GROUP"
	envCrash = "ADAPTERTEST_CRASH_AFTER_COMMIT" // message UUID
	// RunPoisonCrashLoop's child: the message UUID whose handler kills the process, and the
	// inbox's dead-letter topic and MaxAttempts.
	envCrashIn     = "ADAPTERTEST_CRASH_IN_HANDLER"
	envDeadLetters = "ADAPTERTEST_DEAD_LETTER_TOPIC"
	envMaxAttempts = "ADAPTERTEST_MAX_ATTEMPTS"
)

const consumerName = "matrix"

// readyLine starts the line a child prints once its consumer runs, followed by its pid.
const readyLine = "READY "

const schemaSQL = `
CREATE TABLE handler_runs (message_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE deliveries (message_id text NOT NULL, pid int NOT NULL);
`

type payment struct {
	Account int   `json:"account"`
	Amount  int64 `json:"amount"`
	Fail    bool  `json:"fail,omitempty"`
}

func paymentMsg(id string, account int, amount int64, fail bool) *message.Message {
	b, _ := json.Marshal(payment{account, amount, fail})
	return message.NewMessage(id, b)
}

func randomName(prefix string) string {
	var b [5]byte
	_, _ = rand.Read(b[:])
	return prefix + "_" + hex.EncodeToString(b[:])
}

// fixture is one matrix test's database, broker and topic.
type fixture struct {
	t      testing.TB
	h      Harness
	sch    *inboxtest.Schema
	store  *pgstore.Store
	broker *adapters.Broker
	topic  string
	group  string
}

func newFixture(t testing.TB, h Harness) *fixture {
	t.Helper()
	sch := inboxtest.NewSchema(t, "t", 16)
	store := sch.Store(t)
	sch.CreateAccounts(t, 5)
	sch.Exec(t, schemaSQL)
	f := &fixture{t: t, h: h, sch: sch, store: store, topic: randomName("matrix"), group: randomName("group")}
	f.broker = f.newBroker()
	return f
}

func (f *fixture) newBroker() *adapters.Broker {
	b, err := f.h.NewBroker(f.sch.Pool, f.group)
	if err != nil {
		f.t.Fatalf("connect to the broker: %v", err)
	}
	f.t.Cleanup(func() { _ = b.Close() })
	return b
}

func (f *fixture) publish(msgs ...*message.Message) {
	f.t.Helper()
	for _, m := range msgs {
		if err := f.broker.Publisher.Publish(f.topic, m); err != nil {
			f.t.Fatalf("publish: %v", err)
		}
	}
}

func (f *fixture) count(sql string, args ...any) int64 {
	f.t.Helper()
	var n int64
	if err := f.sch.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		f.t.Fatal(err)
	}
	return n
}

func (f *fixture) waitFor(what string, cond func() bool) {
	f.t.Helper()
	deadline := time.Now().Add(f.h.Timeout)
	for !cond() {
		if time.Now().After(deadline) {
			f.t.Fatalf("timed out after %v waiting for %s", f.h.Timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// handler credits the account in the inbox transaction and records its run outside it.
func handler(pool *pgxpool.Pool) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		if _, err := pool.Exec(ctx, "INSERT INTO handler_runs (message_id) VALUES ($1)", msg.UUID); err != nil {
			return err
		}
		var p payment
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return inbox.Permanent(err)
		}
		if p.Fail {
			return errors.New("account frozen")
		}
		tx, ok := pgstore.TxFromContext(ctx)
		if !ok {
			return errors.New("no inbox transaction")
		}
		_, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + $1 WHERE id = $2", p.Amount, p.Account)
		return err
	}
}

// consumer runs a router with n handlers on the topic, each wrapped by ib, and an outer
// middleware that records every delivery and, when crashAfterCommit names a message, kills
// the process once the inbox has committed it (before the router acks).
func consumer(t testing.TB, pool *pgxpool.Pool, b *adapters.Broker, topic string, ib *inbox.Inbox, n int, crashAfterCommit string, slow time.Duration) *message.Router {
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	pid := os.Getpid()
	r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			_, _ = pool.Exec(context.WithoutCancel(msg.Context()), "INSERT INTO deliveries VALUES ($1, $2)", msg.UUID, pid)
			out, err := h(msg)
			if err == nil && crashAfterCommit != "" && msg.UUID == crashAfterCommit {
				_ = syscall.Kill(pid, syscall.SIGKILL) // after the inbox commit, before the ack
				select {}
			}
			if err != nil {
				time.Sleep(20 * time.Millisecond) // no hot redelivery loop on brokers that requeue at once
			}
			return out, err
		}
	}, ib.Middleware)
	h := handler(pool)
	crashIn := os.Getenv(envCrashIn) // RunPoisonCrashLoop's child only
	for i := range n {
		r.AddConsumerHandler(fmt.Sprintf("%s-%d", consumerName, i), topic, b.Subscriber, func(msg *message.Message) error {
			if slow > 0 {
				time.Sleep(slow)
			}
			if crashIn != "" && msg.UUID == crashIn {
				// Inside the handler, its claim uncommitted: the run is recorded outside the
				// inbox transaction, then the process dies.
				_, _ = pool.Exec(context.WithoutCancel(msg.Context()), "INSERT INTO handler_runs (message_id) VALUES ($1)", msg.UUID)
				_ = syscall.Kill(pid, syscall.SIGKILL)
				select {}
			}
			if crashIn != "" {
				// Any other message lingers in its handler, so that one delivered beside the
				// poison one (a subscriber with several deliveries in flight) is still running
				// when the poison one kills the process: a bystander of the crash.
				time.Sleep(bystanderLinger)
			}
			return h(msg)
		})
	}
	go func() { _ = r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("router did not start")
	}
	return r
}

func (f *fixture) inbox(mod ...func(*inbox.Config)) *inbox.Inbox {
	return newInbox(f.t, f.store, f.broker, mod...)
}

func newInbox(t testing.TB, store *pgstore.Store, b *adapters.Broker, mod ...func(*inbox.Config)) *inbox.Inbox {
	cfg := inbox.Config{Store: store, ConsumerName: consumerName, BrokerSideFields: b.BrokerSideFields}
	for _, m := range mod {
		m(&cfg)
	}
	ib, err := inbox.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	return ib
}

// Run runs the matrix as subtests of t.
func Run(t *testing.T, h Harness) {
	if h.Timeout == 0 {
		h.Timeout = 30 * time.Second
	}
	if h.ChildTest == "" {
		h.ChildTest = "TestAdapterChild"
	}
	t.Run("SequentialDuplicate", func(t *testing.T) { sequentialDuplicate(t, h) })
	t.Run("ConcurrentDuplicate", func(t *testing.T) { concurrentDuplicate(t, h) })
	t.Run("CrashBetweenCommitAndAck", func(t *testing.T) { crashBetweenCommitAndAck(t, h) })
	t.Run("PoisonToDeadLetter", func(t *testing.T) { poisonToDeadLetter(t, h) })
	t.Run("BrokerSideFieldsRefused", func(t *testing.T) { brokerSideFieldsRefused(t, h) })
}

func sequentialDuplicate(t *testing.T, h Harness) {
	f := newFixture(t, h)
	ib := f.inbox()
	f.publish(paymentMsg("pay-a", 1, 10, false), paymentMsg("pay-a", 1, 10, false), paymentMsg("pay-b", 1, 5, false))
	r := consumer(t, f.sch.Pool, f.broker, f.topic, ib, 1, "", 0)
	defer r.Close()
	f.waitFor("2 processed and 1 duplicate", func() bool { s := ib.Stats(); return s.Processed == 2 && s.Duplicates >= 1 })
	if b := f.count("SELECT balance FROM accounts WHERE id = 1"); b != 15 {
		t.Fatalf("balance %d, want 15 (the duplicate applied once)", b)
	}
	if runs := f.count("SELECT count(*) FROM handler_runs WHERE message_id = 'pay-a'"); runs != 1 {
		t.Fatalf("handler ran %d times for the duplicated message, want 1", runs)
	}
}

func concurrentDuplicate(t *testing.T, h Harness) {
	f := newFixture(t, h)
	ib := f.inbox()
	const copies = 6
	for range copies {
		f.publish(paymentMsg("pay-same", 2, 100, false))
	}
	r := consumer(t, f.sch.Pool, f.broker, f.topic, ib, 4, "", 150*time.Millisecond)
	defer r.Close()
	f.waitFor("every copy settled", func() bool { s := ib.Stats(); return s.Processed+s.Duplicates >= copies })
	if b := f.count("SELECT balance FROM accounts WHERE id = 2"); b != 100 {
		t.Fatalf("balance %d after %d concurrent copies, want 100", b, copies)
	}
	if s := ib.Stats(); s.Processed != 1 || f.count("SELECT count(*) FROM handler_runs") != 1 {
		t.Fatalf("stats %+v, handler runs %d; want exactly one processed run", s, f.count("SELECT count(*) FROM handler_runs"))
	}
}

// deadLetters is what the test process received on a dead-letter topic.
type deadLetters struct {
	n     atomic.Int64
	first atomic.Value // *message.Message: the first dead letter
}

// subscribeDeadLetters subscribes the test process to the fixture's dead-letter topic (which
// declares it before any consumer publishes to it) and acks what arrives, keeping a count and
// the first message. It returns the topic.
func (f *fixture) subscribeDeadLetters() (string, *deadLetters) {
	f.t.Helper()
	topic := f.topic + "_dead"
	dl, err := f.broker.Subscriber.Subscribe(context.Background(), topic)
	if err != nil {
		f.t.Fatal(err)
	}
	d := &deadLetters{}
	go func() {
		for m := range dl {
			if d.n.Add(1) == 1 {
				d.first.Store(m)
			}
			m.Ack()
		}
	}()
	return topic, d
}

// firstMsg returns the first dead letter, or nil.
func (d *deadLetters) firstMsg() *message.Message {
	m, _ := d.first.Load().(*message.Message)
	return m
}

func poisonToDeadLetter(t *testing.T, h Harness) {
	f := newFixture(t, h)
	dlTopic, dead := f.subscribeDeadLetters()
	ib := f.inbox(func(c *inbox.Config) {
		c.DeadLetterPublisher = f.broker.Publisher
		c.DeadLetterTopic = dlTopic
		c.MaxAttempts = 3
	})
	f.publish(paymentMsg("pay-poison", 3, 7, true), paymentMsg("pay-ok", 3, 1, false))
	r := consumer(t, f.sch.Pool, f.broker, f.topic, ib, 1, "", 0)
	defer r.Close()
	f.waitFor("the dead letter", func() bool { return dead.n.Load() >= 1 && ib.Stats().Processed >= 1 })
	time.Sleep(300 * time.Millisecond) // a second dead letter would arrive by now
	if n := dead.n.Load(); n != 1 {
		t.Fatalf("%d dead letters, want 1", n)
	}
	if runs := f.count("SELECT count(*) FROM handler_runs WHERE message_id = 'pay-poison'"); runs != 3 {
		t.Fatalf("handler ran %d times for the poison message, want 3 (MaxAttempts)", runs)
	}
	if b := f.count("SELECT balance FROM accounts WHERE id = 3"); b != 1 {
		t.Fatalf("balance %d, want 1 (only the healthy payment)", b)
	}
	if dead.firstMsg().Metadata.Get("reason_poisoned") == "" {
		t.Fatal("dead letter without reason_poisoned")
	}
}

func brokerSideFieldsRefused(t *testing.T, h Harness) {
	f := newFixture(t, h)
	for field := range f.broker.BrokerSideFields {
		if _, err := inbox.MetadataKey(field, f.broker.BrokerSideFields); !errors.Is(err, inbox.ErrBrokerSideKey) {
			t.Errorf("MetadataKey(%q) = %v, want ErrBrokerSideKey", field, err)
		}
	}
}

func crashBetweenCommitAndAck(t *testing.T, h Harness) {
	f := newFixture(t, h)
	f.publish(paymentMsg("pay-1", 4, 1, false), paymentMsg("pay-crash", 4, 10, false), paymentMsg("pay-3", 4, 100, false))
	_ = f.broker.Close() // the parent only publishes; the children consume

	first := f.startChild("pay-crash")
	if err := first.WaitExit(t, f.h.Timeout); !inboxtest.KilledBySIGKILL(err) {
		t.Fatalf("first child ended with %v, want death by SIGKILL at the injected point", err)
	}
	if n := f.count("SELECT count(*) FROM inbox_processed_messages WHERE message_id = 'pay-crash'"); n != 1 {
		t.Fatalf("the crashed delivery's claim is not committed (%d rows)", n)
	}
	second := f.startChild("") // killed when t ends
	f.waitFor("all three payments, and the crashed one redelivered", func() bool {
		return f.count("SELECT count(*) FROM inbox_processed_messages") == 3 &&
			f.count("SELECT count(*) FROM deliveries WHERE message_id = 'pay-crash' AND pid = $1", second.Pid()) >= 1
	})
	if b := f.count("SELECT balance FROM accounts WHERE id = 4"); b != 111 {
		t.Fatalf("balance %d, want 111 (each payment once)", b)
	}
	if runs := f.count("SELECT count(*) FROM handler_runs WHERE message_id = 'pay-crash'"); runs != 1 {
		t.Fatalf("handler ran %d times for the message committed before the crash, want 1", runs)
	}
}

// startChild re-executes the test binary to run h.ChildTest as a consumer of the fixture's
// topic that SIGKILLs itself after the inbox committed message crash (never when crash is
// empty), with the extra environment more. It does not wait for the child's READY line: the
// child may consume, and kill itself, before it prints it. The child is killed when the test
// ends.
func (f *fixture) startChild(crash string, more ...string) *inboxtest.Child {
	f.t.Helper()
	env := append(append([]string{}, f.h.Env...),
		envChild+"=1", envDB+"="+f.sch.URL, envSch+"="+f.sch.Name, envTopic+"="+f.topic, envGroup+"="+f.group, envCrash+"="+crash)
	return inboxtest.StartChild(f.t, f.h.ChildTest, append(env, more...))
}

// bystanderLinger is how long RunPoisonCrashLoop's child holds a healthy message in its
// handler before applying it.
const bystanderLinger = 200 * time.Millisecond

// RunPoisonCrashLoop checks the broker's redelivery signal (adapters.Broker.Redelivery) against
// a message that kills its consumer every time its handler runs: each child process, with
// dead letters on (MaxAttempts 2) and the broker's signal, SIGKILLs itself inside the handler;
// the broker's own redelivery brings the message to the next child. The message must reach
// the dead-letter topic after at most MaxAttempts + 1 handler runs (docs/design.md, "The worst
// case": a signalled first delivery is not counted up front) and at least MaxAttempts, its
// claim never committed and its payment never applied, the dead letter being the message as
// published, while a healthy message published after it is applied once: never dead-lettered,
// though on a subscriber with several deliveries in flight it is in its handler (the child holds
// it there for bystanderLinger) each time the poison one kills the child, so every crash it
// shares is charged to it too until crash isolation runs it alone. A signal that called
// a redelivery a first delivery would let the loop run on: the test fails after MaxAttempts + 2
// children. It needs h.ChildTest's test function to call Child.
func RunPoisonCrashLoop(t *testing.T, h Harness) {
	if h.Timeout == 0 {
		h.Timeout = 30 * time.Second
	}
	if h.ChildTest == "" {
		h.ChildTest = "TestAdapterChild"
	}
	const maxAttempts = 2
	f := newFixture(t, h)
	dlTopic, dead := f.subscribeDeadLetters()
	poison := paymentMsg("pay-crasher", 2, 5, false)
	f.publish(poison, paymentMsg("pay-fine", 2, 1, false))
	env := []string{envCrashIn + "=pay-crasher", envDeadLetters + "=" + dlTopic, envMaxAttempts + "=" + strconv.Itoa(maxAttempts)}
	for n := 1; dead.n.Load() == 0; n++ {
		if n > maxAttempts+2 {
			t.Fatalf("%d children died and no dead letter came (handler runs %d): the redelivery signal let a crash go uncounted",
				n-1, f.count("SELECT count(*) FROM handler_runs WHERE message_id = 'pay-crasher'"))
		}
		c := f.startChild("", env...)
		deadline := time.Now().Add(2 * f.h.Timeout)
		for {
			if exited, err := c.Exited(); exited {
				if !inboxtest.KilledBySIGKILL(err) {
					t.Fatalf("child %d ended with %v, want death by SIGKILL in the handler", n, err)
				}
				break
			}
			if dead.n.Load() > 0 {
				break // this child dead-lettered the message and lives on
			}
			if time.Now().After(deadline) {
				t.Fatalf("child %d neither died nor dead-lettered the message within %s", n, 2*f.h.Timeout)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	f.waitFor("the healthy payment", func() bool {
		return f.count("SELECT count(*) FROM inbox_processed_messages WHERE message_id = 'pay-fine'") == 1
	})
	time.Sleep(300 * time.Millisecond) // a second dead letter would arrive by now
	runs := f.count("SELECT count(*) FROM handler_runs WHERE message_id = 'pay-crasher'")
	switch {
	case dead.n.Load() != 1:
		t.Fatalf("%d dead letters, want 1", dead.n.Load())
	case runs < maxAttempts || runs > maxAttempts+1:
		t.Fatalf("the crashing handler ran %d times, want %d or %d (MaxAttempts, one more when the broker signalled the first delivery)", runs, maxAttempts, maxAttempts+1)
	case dead.firstMsg().UUID != poison.UUID || string(dead.firstMsg().Payload) != string(poison.Payload):
		t.Fatalf("dead letter %s %s, want the original %s %s", dead.firstMsg().UUID, dead.firstMsg().Payload, poison.UUID, poison.Payload)
	}
	if n := f.count("SELECT count(*) FROM inbox_processed_messages WHERE message_id = 'pay-crasher'"); n != 0 {
		t.Fatalf("the crashing message's claim committed (%d rows)", n)
	}
	if b := f.count("SELECT balance FROM accounts WHERE id = 2"); b != 1 {
		t.Fatalf("balance %d, want 1 (the healthy payment only)", b)
	}
	t.Logf("the crashing handler ran %d times before the dead letter (MaxAttempts %d)", runs, maxAttempts)
}

// Child is the crash test's consumer process. It returns at once unless the test binary was
// started by the matrix; then it prints a READY line once its router runs and consumes until
// it is killed, gets SIGTERM, or has run for inboxtest.ChildMaxLifetime (which fails it).
func Child(t *testing.T, h Harness) {
	if os.Getenv(envChild) != "1" {
		return
	}
	if os.Getenv(envBatchChild) == "1" {
		batchedChild(t, h) // RunBatchedCrashes's child
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	pool := inboxtest.NewPool(t, os.Getenv(envDB), 8)
	b, err := h.NewBroker(pool, os.Getenv(envGroup))
	if err != nil {
		t.Fatalf("child: broker: %v", err)
	}
	store, err := pgstore.New(pool, pgstore.Config{Schema: os.Getenv(envSch)})
	if err != nil {
		t.Fatal(err)
	}
	cfg := inbox.Config{Store: store, ConsumerName: consumerName, BrokerSideFields: b.BrokerSideFields}
	if topic := os.Getenv(envDeadLetters); topic != "" {
		// RunPoisonCrashLoop: dead letters, with the broker's redelivery signal.
		cfg.DeadLetterPublisher, cfg.DeadLetterTopic, cfg.Redelivery = b.Publisher, topic, b.Redelivery
		if cfg.MaxAttempts, err = strconv.Atoi(os.Getenv(envMaxAttempts)); err != nil {
			t.Fatalf("child: %s: %v", envMaxAttempts, err)
		}
	}
	ib, err := inbox.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := consumer(t, pool, b, os.Getenv(envTopic), ib, 1, os.Getenv(envCrash), 0)
	fmt.Printf("%s%d\n", readyLine, os.Getpid())
	inboxtest.WaitChildStop(t, ctx, "adaptertest child")
	_ = r.Close()
}
