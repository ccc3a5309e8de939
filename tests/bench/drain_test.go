package bench

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	natsgo "github.com/nats-io/nats.go"
	amqp091 "github.com/rabbitmq/amqp091-go"
	goredis "github.com/redis/go-redis/v9"

	_ "github.com/watermill-inbox/watermill-inbox/adapters/all" // every broker name
	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkatest"
	"github.com/watermill-inbox/watermill-inbox/adapters/nats"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs/sqstest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

var (
	backlogFlag = flag.Int("backlog", 5000, "BenchmarkBacklogDrain: messages pre-published per mode and broker before each timed drain")
	brokersFlag = flag.String("brokers", "postgres,amqp,kafka,sqs,nats,redis", "BenchmarkBacklogDrain: comma-separated brokers to run")
	modesFlag   = flag.String("drain-modes", "raw,bare,inbox,inbox-dlq", "BenchmarkBacklogDrain: comma-separated modes to run (raw, bare, inbox, inbox-dlq)")
)

// TestMain runs goaws, the SQS emulator, in process for the "sqs" broker.
func TestMain(m *testing.M) { sqstest.Main(m) }

// drainConcurrency is the number of deliveries each broker's consumer runs at once, set the way
// a user would set it (see brokerConfig); watermill-sql delivers one message at a time per
// consumer group, so the postgres broker runs 1.
const drainConcurrency = 8

// drainMode is one row of BenchmarkBacklogDrain: how a consumer of the backlog is set up.
type drainMode struct {
	name string
	// add registers the consumer of topic on r, handlers times (competing handlers of one
	// consumer group, for a broker whose concurrency comes from its handler count), and
	// returns how many messages its business writes applied so far (nil: none).
	add func(e *drainEnv, r *router.Router, topic string, handlers int) (applied func() uint64, err error)
}

// drainEnv is what the modes share within one broker's run.
type drainEnv struct {
	b        testing.TB
	sch      *testenv.Schema
	store    *pgstore.Store
	accounts int
}

// update is the work of every mode with a database: one UPDATE on a random account row.
func (e *drainEnv) update(ctx context.Context, tx pgx.Tx) error {
	_, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance + 1 WHERE id = $1", rand.IntN(e.accounts)+1)
	return err
}

// subscriber returns the subscriber of consumer group group on r's broker (the broker's own
// subscriber on sqs, whose queue is the topic), closed when the benchmark ends.
func (e *drainEnv) subscriber(r *router.Router, group string) (message.Subscriber, error) {
	if r.Broker.NewSubscriber == nil {
		return r.Broker.Subscriber, nil
	}
	sub, err := r.Broker.SubscriberFor(group)
	if err == nil {
		e.b.Cleanup(func() { _ = sub.Close() })
	}
	return sub, err
}

// drainModes are the rows, in the order they run. The batched (group-commit) inbox and the
// store-then-process mode are added here as further entries.
func drainModes() []drainMode {
	modes := []drainMode{
		{name: "raw", add: func(e *drainEnv, r *router.Router, topic string, handlers int) (func() uint64, error) {
			// No database: the broker's and Watermill's own consume rate.
			sub, err := e.subscriber(r, "raw")
			if err != nil {
				return nil, err
			}
			for i := range handlers {
				r.AddConsumerHandler(fmt.Sprintf("raw-%d", i), topic, sub, func(*message.Message) error { return nil })
			}
			return nil, nil
		}},
		{name: "bare", add: func(e *drainEnv, r *router.Router, topic string, handlers int) (func() uint64, error) {
			// BEGIN, the UPDATE, COMMIT: the same work without a claim.
			sub, err := e.subscriber(r, "bare")
			if err != nil {
				return nil, err
			}
			var applied atomic.Uint64
			for i := range handlers {
				r.AddConsumerHandler(fmt.Sprintf("bare-%d", i), topic, sub, func(m *message.Message) error {
					tx, err := e.sch.Pool.BeginTx(m.Context(), pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
					if err != nil {
						return err
					}
					if err := e.update(m.Context(), tx); err != nil {
						_ = tx.Rollback(context.WithoutCancel(m.Context()))
						return err
					}
					if err := tx.Commit(context.WithoutCancel(m.Context())); err != nil {
						return err
					}
					applied.Add(1)
					return nil
				})
			}
			return applied.Load, nil
		}},
		{name: "inbox", add: func(e *drainEnv, r *router.Router, topic string, handlers int) (func() uint64, error) {
			return addInbox(e, r, topic, handlers, inbox.Config{Store: e.store, ConsumerName: "inbox"})
		}},
		{name: "inbox-dlq", add: func(e *drainEnv, r *router.Router, topic string, handlers int) (func() uint64, error) {
			// With a dead-letter topic: durable attempt counting, with the broker's own
			// redelivery signal (router.NewInbox fills it in): AMQP and NATS signal first
			// deliveries, Kafka those of records appended after the consumer was assigned
			// their partition (the backlog here is published after the consumers joined);
			// watermill-sql, Redis Streams and SQS standard queues do not, so every delivery
			// there is counted before its handler runs.
			return addInbox(e, r, topic, handlers, inbox.Config{Store: e.store, ConsumerName: "inbox_dlq",
				DeadLetterPublisher: r.Broker.Publisher, DeadLetterTopic: topic + "_dead"})
		}},
		// BATCHED INBOX (issue 12 item 1): add the group-commit mode here, e.g.
		//	{name: "batched", add: func(e *drainEnv, r *router.Router, topic string, handlers int) (func() uint64, error) {
		//		return addInbox(e, r, topic, handlers, inbox.Config{Store: e.store, ConsumerName: "batched", <batch settings>})
		//	}},
		// and name it in -drain-modes' default.
		//
		// STORE-THEN-PROCESS (package middleware/deferred): add it here the same way; its
		// applied count must rise when the deferred work has run, not when the message was
		// stored, so the drain times the work.
	}
	want := map[string]bool{}
	for _, m := range strings.Split(*modesFlag, ",") {
		want[strings.TrimSpace(m)] = true
	}
	var out []drainMode
	for _, m := range modes {
		if want[m.name] {
			out = append(out, m)
		}
	}
	return out
}

// addInbox adds handlers inbox consumers (router.AddConsumer, the inbox innermost) doing the
// UPDATE in the inbox transaction.
func addInbox(e *drainEnv, r *router.Router, topic string, handlers int, cfg inbox.Config) (func() uint64, error) {
	ib, err := r.NewInbox(cfg, nil)
	if err != nil {
		return nil, err
	}
	for range handlers {
		if _, err := r.AddConsumer(ib, topic, func(m *message.Message) error {
			tx, _ := pgstore.TxFromContext(m.Context())
			return e.update(m.Context(), tx)
		}); err != nil {
			return nil, err
		}
	}
	return func() uint64 { return ib.Stats().Processed }, nil
}

// BenchmarkBacklogDrain measures how fast a consumer drains a backlog that is already in the
// broker, per broker, for each mode in one run: raw (no database: the broker's and Watermill's
// consume rate), bare (BEGIN, one UPDATE, COMMIT), inbox (the same UPDATE in the inbox
// transaction) and inbox-dlq (the inbox with a dead-letter topic, using the broker's
// redelivery signal). See docs/benchmarks.md for the command and the figures.
//
// Per broker and mode: a router with the mode's consumer runs and is warmed up (2 messages
// per delivery slot); a gate in front of the handlers is closed; -backlog messages are
// published (16 publishers in parallel, not timed); then the gate opens and the clock runs
// until every message of the backlog was handled and acked by the handler chain. Before the
// timed drains every mode does one untimed drain of a tenth of the backlog (a rehearsal). Modes take
// turns (their order rotates from one -count run to the next), so their ratios are measured
// under the same machine load. Each message is acked only after its transaction committed.
// SQS (goaws, an emulator) drains a quarter of -backlog.
//
//	cd tests/bench && go test . -run '^$' -bench BacklogDrain -benchtime 1x -count 3 -backlog 5000
func BenchmarkBacklogDrain(b *testing.B) {
	for _, name := range strings.Split(*brokersFlag, ",") {
		b.Run("broker="+strings.TrimSpace(name), func(b *testing.B) { benchDrain(b, strings.TrimSpace(name)) })
	}
}

var drainRun atomic.Int64 // rotates the mode order from one run to the next

func benchDrain(b *testing.B, broker string) {
	const accounts = 10000
	sch := testenv.NewSchema(b, 10)
	e := &drainEnv{b: b, sch: sch, store: sch.Store(b), accounts: accounts}
	sch.CreateAccounts(b, accounts)
	modes := drainModes()
	topics := make([]string, len(modes))
	for i, m := range modes {
		topics[i] = "drain_" + strings.ReplaceAll(m.name, "-", "_") + "_" + sch.Name
	}
	cfg, handlers := brokerConfig(b, broker, topics)
	backlog := *backlogFlag
	if broker == "sqs" {
		// goaws, an emulator, publishes and delivers a few hundred messages a second on this
		// machine: a quarter of the backlog keeps the run within its time budget.
		backlog = max(1, backlog/4)
	}

	type running struct {
		mode    drainMode
		r       *router.Router
		topic   string
		g       *gate
		done    *atomic.Uint64
		applied func() uint64
	}
	var runs []*running
	for i, m := range modes {
		r, err := router.New(cfg, sch.Pool, nil)
		if err != nil {
			b.Fatal(err)
		}
		run := &running{mode: m, r: r, topic: topics[i], g: newGate(), done: new(atomic.Uint64)}
		r.AddMiddleware(run.g.middleware(run.done))
		if run.applied, err = m.add(e, r, run.topic, handlers); err != nil {
			b.Fatal(err)
		}
		go func() { _ = r.Run(context.Background()) }()
		<-r.Running()
		b.Cleanup(func() { _ = r.Close(); deleteTopic(cfg, run.topic) })
		runs = append(runs, run)
	}
	// Warm up every mode: subscriptions joined (consumer-group rebalances, queues declared),
	// connections open, statements prepared.
	warm := 2 * drainConcurrency
	for _, run := range runs {
		run.g.open()
		publishBacklog(b, run.r.Broker.Publisher, run.topic, warm, true)
	}
	for _, run := range runs {
		waitDone(b, run.mode.name, run.done, uint64(warm))
	}

	// drain publishes n messages behind the closed gate of run, opens it and returns how
	// long the publish and the drain took.
	drain := func(run *running, n int) (publish, elapsed time.Duration) {
		run.g.close()
		base := run.done.Load() // nothing passes the closed gate
		start := time.Now()
		publishBacklog(b, run.r.Broker.Publisher, run.topic, n, false)
		publish = time.Since(start)
		start = time.Now()
		run.g.open()
		waitDone(b, run.mode.name, run.done, base+uint64(n))
		return publish, time.Since(start)
	}
	// A rehearsal, untimed: the first gated drain of a run was measured slower than the
	// next ones whatever its mode (on a loaded machine), so every mode drains once first.
	rehearsal := max(1, backlog/10)
	for _, run := range runs {
		drain(run, rehearsal)
	}
	warm += rehearsal

	b.ResetTimer()
	shift := int(drainRun.Add(1))
	elapsed := make([]time.Duration, len(runs))
	var publishT time.Duration
	for k := range runs {
		i := (k + shift) % len(runs)
		p, d := drain(runs[i], backlog)
		publishT += p
		elapsed[i] = d
	}
	b.StopTimer()

	rates := map[string]float64{}
	for i, run := range runs {
		rates[run.mode.name] = float64(backlog) / elapsed[i].Seconds()
		b.ReportMetric(rates[run.mode.name], run.mode.name+"-msg/s")
	}
	b.ReportMetric(float64(backlog*len(runs))/publishT.Seconds(), "publish-msg/s")
	ratio := func(a, c string) {
		if rates[a] > 0 && rates[c] > 0 {
			b.ReportMetric(rates[a]/rates[c], a+"/"+c)
		}
	}
	ratio("bare", "raw")
	ratio("inbox", "raw")
	ratio("inbox", "bare")
	ratio("inbox-dlq", "bare")
	b.ReportMetric(0, "ns/op")

	// Business state: every committed UPDATE added 1 to one balance.
	var applied uint64
	for _, run := range runs {
		if run.applied != nil {
			n := run.applied()
			if n < uint64(warm+backlog) {
				b.Fatalf("%s on %s: %d messages applied, want at least %d", run.mode.name, broker, n, warm+backlog)
			}
			applied += n
		}
	}
	var sum int64
	if err := sch.Pool.QueryRow(context.Background(), "SELECT coalesce(sum(balance), 0) FROM accounts").Scan(&sum); err != nil {
		b.Fatal(err)
	}
	if uint64(sum) != applied {
		b.Fatalf("%s: balances sum to %d, want %d (one per committed UPDATE)", broker, sum, applied)
	}
}

// brokerConfig returns the router configuration of broker, with the consumer's concurrency
// set the way a user would, and how many handlers each mode registers:
//   - amqp: 8 AMQP consumers (amqp.Config.Consumers), each with RabbitMQ's prefetch of 16;
//   - kafka: topics of 8 partitions on an in-process kfake cluster, one subscriber (watermill-
//     kafka handles each partition it owns in a goroutine of its own);
//   - nats: 8 JetStream subscriptions (SubscribersCount), MaxAckPending 64;
//   - redis: 8 handlers of one consumer group (each Subscribe is a consumer loop);
//   - sqs: MaxInFlight 8 on goaws, in process;
//   - postgres: watermill-sql, one message at a time per consumer group.
func brokerConfig(b *testing.B, broker string, topics []string) (router.Config, int) {
	switch broker {
	case "postgres":
		return router.Config{Broker: "postgres"}, 1
	case "amqp":
		return router.Config{Broker: "amqp", URL: testenv.RequireAMQP(b), Settings: map[string]any{amqp.Name: &amqp.Config{
			Consumers: drainConcurrency, Prefetch: 16, PublishChannelPoolSize: 16,
			QueueArguments: map[string]any{"x-expires": int32(120000)},
		}}}, 1
	case "kafka":
		var seed []kafkatest.Topic
		for _, t := range topics {
			seed = append(seed, kafkatest.Topic{Name: t, Partitions: drainConcurrency})
		}
		cluster := kafkatest.NewCluster(b, seed...)
		return router.Config{Broker: "kafka", URL: "kafka://" + strings.Join(cluster.Addrs(), ",")}, 1
	case "nats":
		return router.Config{Broker: "nats", URL: testenv.RequireNATS(b), Settings: map[string]any{nats.Name: &nats.Config{
			SubscribersCount: drainConcurrency, MaxAckPending: 64,
		}}}, 1
	case "redis":
		return router.Config{Broker: "redis", URL: testenv.RequireRedis(b)}, drainConcurrency
	case "sqs":
		return router.Config{Broker: "sqs", URL: sqstest.Endpoint(), SQSQueryProtocol: true, Settings: map[string]any{sqs.Name: &sqs.BrokerConfig{
			AWSConfig: sqstest.AWSConfig(), MaxInFlight: drainConcurrency,
		}}}, 1
	}
	b.Fatalf("unknown broker %q", broker)
	return router.Config{}, 0
}

// gate holds deliveries (except warm-up messages) while it is closed, and counts the
// deliveries the handler chain behind it settled (returned nil for: the router acks).
type gate struct {
	mu sync.Mutex
	ch chan struct{}
}

func newGate() *gate { return &gate{ch: make(chan struct{})} }

func (g *gate) close() { g.mu.Lock(); g.ch = make(chan struct{}); g.mu.Unlock() }
func (g *gate) open()  { g.mu.Lock(); close(g.ch); g.mu.Unlock() }

func (g *gate) middleware(done *atomic.Uint64) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			if m.Metadata.Get("warm") == "" {
				g.mu.Lock()
				ch := g.ch
				g.mu.Unlock()
				<-ch
			}
			out, err := h(m)
			if err == nil {
				done.Add(1)
			}
			return out, err
		}
	}
}

// publishBacklog publishes n messages to topic from 16 publishers in parallel, 50 messages
// per Publish call (one INSERT on watermill-sql; one call per message on the other brokers).
func publishBacklog(b testing.TB, pub message.Publisher, topic string, n int, warm bool) {
	const publishers, chunk = 16, 50
	var next atomic.Int64
	var wg sync.WaitGroup
	for range publishers {
		wg.Go(func() {
			for {
				from := int(next.Add(chunk)) - chunk
				if from >= n {
					return
				}
				msgs := make([]*message.Message, 0, chunk)
				for range min(chunk, n-from) {
					m := message.NewMessage(uuid.NewString(), []byte(`{}`))
					if warm {
						m.Metadata.Set("warm", "1")
					}
					msgs = append(msgs, m)
				}
				if err := pub.Publish(topic, msgs...); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if b.Failed() {
		b.FailNow()
	}
}

// waitDone waits until done reaches n, for at most a minute.
func waitDone(b testing.TB, mode string, done *atomic.Uint64, n uint64) {
	deadline := time.Now().Add(time.Minute)
	for done.Load() < n {
		if time.Now().After(deadline) {
			b.Fatalf("%s: %d of %d messages settled after a minute (the postgres broker stalls while any transaction in the database stays open: watermill-sql reads only below the oldest running transaction)", mode, done.Load(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// deleteTopic removes what a run left on a shared broker: a NATS stream, a Redis stream, the
// RabbitMQ exchange and queues (which expire anyway). PostgreSQL's go with the schema, and
// kfake and goaws live in this process.
func deleteTopic(cfg router.Config, topic string) {
	switch cfg.Broker {
	case "nats":
		nc, err := natsgo.Connect(cfg.URL)
		if err != nil {
			return
		}
		defer nc.Close()
		if js, err := nc.JetStream(); err == nil {
			_ = js.DeleteStream(topic)
			_ = js.DeleteStream(topic + "_dead")
		}
	case "redis":
		opts, err := goredis.ParseURL(cfg.URL)
		if err != nil {
			return
		}
		c := goredis.NewClient(opts)
		defer c.Close()
		_ = c.Del(context.Background(), topic, topic+"_dead").Err()
	case "amqp":
		conn, err := amqp091.Dial(cfg.URL)
		if err != nil {
			return
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		for _, g := range []string{"raw", "bare", "inbox", "inbox_dlq", "batched", router.DefaultConsumerGroup} {
			_, _ = ch.QueueDelete(amqp.QueueName(topic, g), false, false, false)
		}
		_, _ = ch.QueueDelete(topic, false, false, false)
		_ = ch.ExchangeDelete(topic, false, false)
	}
}
