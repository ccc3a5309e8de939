package redis_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	goredis "github.com/redis/go-redis/v9"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/adaptertest"
	"github.com/watermill-inbox/watermill-inbox/adapters/redis"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// maxIdle is the tests' MaxIdleTime: a crashed consumer's entries are claimed after it.
const maxIdle = time.Second

// testConfig is the adapter's configuration in these tests: short claim and resend times.
func testConfig(t testing.TB, group string) redis.Config {
	cfg := redis.Config{
		URL:             testenv.RequireRedis(t),
		ConsumerGroup:   group,
		MaxIdleTime:     maxIdle,
		ClaimInterval:   200 * time.Millisecond,
		NackResendSleep: 20 * time.Millisecond,
	}
	if os.Getenv(envRecoveryDefaults) != "" {
		cfg.MaxIdleTime, cfg.ClaimInterval = 0, 0
	}
	return cfg
}

// newBroker connects and deletes, when t ends, every stream the broker touched.
func newBroker(t testing.TB, cfg redis.Config) (*adapters.Broker, error) {
	b, err := redis.New(cfg, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	adaptertest.CleanupTopics(t, b, func(topics []string) { deleteStreams(t, cfg.URL, topics) })
	return b, nil
}

func harness(t testing.TB) adaptertest.Harness {
	return adaptertest.Harness{
		NewBroker: func(_ *pgxpool.Pool, group string) (*adapters.Broker, error) {
			return newBroker(t, testConfig(t, group))
		},
		Timeout: 20 * time.Second,
	}
}

func TestGuarantees(t *testing.T)   { adaptertest.Run(t, harness(t)) }
func TestAdapterChild(t *testing.T) { adaptertest.Child(t, harness(t)) }

// TestPoisonCrashLoop: a message that SIGKILLs its consumer inside the handler every time is
// dead-lettered after MaxAttempts or MaxAttempts + 1 runs, by the broker's own redeliveries:
// the adapter's redelivery signal never calls a redelivery a first delivery.
func TestPoisonCrashLoop(t *testing.T) { adaptertest.RunPoisonCrashLoop(t, harness(t)) }

// envRecoveryDefaults makes TestAdapterChild use the adapter's default timings.
const envRecoveryDefaults = "INBOX_RECOVERY_DEFAULTS"

// BenchmarkRecoveryAfterSIGKILL: docs/operations.md's recovery figures, with the adapter's
// defaults and with this file's test timings
// (go test ./adapters/redis -run '^$' -bench RecoveryAfterSIGKILL).
func BenchmarkRecoveryAfterSIGKILL(b *testing.B) {
	b.Run("defaults", func(b *testing.B) {
		adaptertest.BenchmarkRecovery(b, adaptertest.Harness{
			NewBroker: func(_ *pgxpool.Pool, group string) (*adapters.Broker, error) {
				cfg := testConfig(b, group)
				cfg.MaxIdleTime, cfg.ClaimInterval = 0, 0 // the adapter's defaults
				return newBroker(b, cfg)
			},
			Timeout: 2 * time.Minute,
			Env:     []string{envRecoveryDefaults + "=1"}, // the child consumer too
		})
	})
	b.Run("test timings", func(b *testing.B) { adaptertest.BenchmarkRecovery(b, harness(b)) })
}

func TestConfigValidate(t *testing.T) {
	for _, cfg := range []redis.Config{
		{ConsumerGroup: "g"},
		{URL: "redis://127.0.0.1:6379/0"},
		{URL: "http://x", ConsumerGroup: "g"},
		{URL: "redis://127.0.0.1:6379/0", ConsumerGroup: "g", MaxIdleTime: -time.Second},
	} {
		if _, err := redis.New(cfg, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("New(%+v) = %v, want ErrInvalidConfig", cfg, err)
		}
	}
}

// TestUnmarshallerNeverFails: watermill-redisstream ends the subscription on an unmarshal
// error. The adapter's unmarshaller reads what the default marshaller writes, and turns a
// missing UUID or undecodable metadata into an empty UUID instead of an error.
func TestUnmarshallerNeverFails(t *testing.T) {
	in := message.NewMessage("order-7", []byte("x"))
	in.Metadata.Set("name", "OrderPlaced")
	values, err := redisstream.DefaultMarshallerUnmarshaller{}.Marshal("orders", in)
	if err != nil {
		t.Fatal(err)
	}
	// Redis returns every field as a string.
	stored := map[string]any{}
	for k, v := range values {
		switch v := v.(type) {
		case []byte:
			stored[k] = string(v)
		default:
			stored[k] = v
		}
	}
	msg, err := redis.Unmarshaller{}.Unmarshal(stored)
	if err != nil || msg.UUID != "order-7" || string(msg.Payload) != "x" || msg.Metadata.Get("name") != "OrderPlaced" {
		t.Fatalf("round trip: %v %+v", err, msg)
	}

	for name, values := range map[string]map[string]any{
		"no fields":    nil,
		"no UUID":      {"payload": "x", "metadata": ""},
		"bad metadata": {redisstream.UUIDHeaderKey: "order-8", "payload": "x", "metadata": "\xc1not msgpack"},
	} {
		msg, err := redis.Unmarshaller{}.Unmarshal(values)
		if err != nil || msg.UUID != "" {
			t.Errorf("%s: err %v, uuid %q; want no error and an empty UUID", name, err, msg.UUID)
		}
		if name == "bad metadata" && !strings.Contains(msg.Metadata.Get(redis.UnmarshalErrorKey), "order-8") {
			t.Errorf("bad metadata: %v", msg.Metadata)
		}
	}
}

// TestMissingUUIDIsDeadLettered writes, with a plain Redis client, an entry without the UUID
// field and one with undecodable metadata, then publishes a normal message. With
// watermill-redisstream's own unmarshaler the first entry would end the subscription; here
// both reach the inbox with an empty UUID, are refused as permanent and dead-lettered without
// running the handler, and the normal message is processed.
func TestMissingUUIDIsDeadLettered(t *testing.T) {
	group := fmt.Sprintf("g_%d", time.Now().UnixNano())
	b, err := newBroker(t, testConfig(t, group))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	topic := fmt.Sprintf("nouuid_%d", time.Now().UnixNano())
	dlTopic := topic + "_dead"

	sch := testenv.NewSchema(t, 8)
	store := sch.Store(t)
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "orders", BrokerSideFields: b.BrokerSideFields,
		DeadLetterPublisher: b.Publisher, DeadLetterTopic: dlTopic}, nil)
	if err != nil {
		t.Fatal(err)
	}
	dl, err := b.Subscriber.Subscribe(context.Background(), dlTopic)
	if err != nil {
		t.Fatal(err)
	}

	rc := client(t)
	ctx := context.Background()
	if err := rc.XAdd(ctx, &goredis.XAddArgs{Stream: topic, Values: map[string]any{"payload": "no id"}}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rc.XAdd(ctx, &goredis.XAddArgs{Stream: topic, Values: map[string]any{
		redisstream.UUIDHeaderKey: "order-0", "payload": "bad metadata", "metadata": "\xc1"}}).Err(); err != nil {
		t.Fatal(err)
	}
	if err := b.Publisher.Publish(topic, message.NewMessage("order-1", []byte("good"))); err != nil {
		t.Fatal(err)
	}

	var runs sync.Map
	var processed atomic.Int64
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddConsumerHandler("orders", topic, b.Subscriber, func(msg *message.Message) error {
		runs.Store(string(msg.Payload), true)
		processed.Add(1)
		return nil
	}).AddMiddleware(ib.Middleware)
	go func() { _ = r.Run(context.Background()) }()
	defer r.Close()
	<-r.Running()

	dead := map[string]string{}
	for len(dead) < 2 {
		select {
		case m := <-dl:
			m.Ack()
			dead[string(m.Payload)] = m.Metadata.Get(wmmiddleware.ReasonForPoisonedKey)
		case <-time.After(20 * time.Second):
			t.Fatalf("dead letters %v, want the two entries without a usable UUID", dead)
		}
	}
	for payload, reason := range dead {
		if (payload != "no id" && payload != "bad metadata") || !strings.Contains(reason, "empty") {
			t.Fatalf("dead letter %q with reason %q", payload, reason)
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for processed.Load() < 1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if _, ok := runs.Load("good"); !ok || processed.Load() != 1 {
		t.Fatalf("processed %d, want only the good message (the subscription must survive)", processed.Load())
	}
}

// TestPendingEntryClaimedByNewConsumer: a consumer reads an entry and goes away without
// acking; a subscriber with another consumer name claims it once it is idle for MaxIdleTime.
func TestPendingEntryClaimedByNewConsumer(t *testing.T) {
	group := fmt.Sprintf("g_%d", time.Now().UnixNano())
	topic := fmt.Sprintf("pending_%d", time.Now().UnixNano())
	cfg := testConfig(t, group)
	cfg.Consumer = "first"
	first, err := newBroker(t, cfg)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := first.Subscriber.Subscribe(context.Background(), topic)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Publisher.Publish(topic, message.NewMessage("order-9", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		if m.UUID != "order-9" {
			t.Fatalf("got %q", m.UUID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("not delivered")
	}
	_ = first.Close() // neither acked nor nacked

	cfg.Consumer = "second"
	second, err := newBroker(t, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	msgs, err = second.Subscriber.Subscribe(context.Background(), topic)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		m.Ack()
		if m.UUID != "order-9" {
			t.Fatalf("got %q", m.UUID)
		}
	case <-time.After(maxIdle + 10*time.Second):
		t.Fatal("the pending entry of the departed consumer was never claimed")
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		p, err := client(t).XPending(context.Background(), topic, group).Result()
		if err != nil {
			t.Fatal(err)
		}
		if p.Count == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("still pending after the ack: %+v", p)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func client(t testing.TB) *goredis.Client {
	opts, err := goredis.ParseURL(testenv.RequireRedis(t))
	if err != nil {
		t.Fatal(err)
	}
	c := goredis.NewClient(opts)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// deleteStreams removes the streams (and their groups) a test created.
func deleteStreams(t testing.TB, url string, keys []string) {
	if len(keys) == 0 {
		return
	}
	opts, err := goredis.ParseURL(url)
	if err != nil {
		return
	}
	c := goredis.NewClient(opts)
	defer c.Close()
	if err := c.Del(context.Background(), keys...).Err(); err != nil {
		t.Logf("cleanup: %v", err)
	}
}

// BenchmarkInboxVsBare: go test ./adapters/redis -run '^$' -bench . -benchtime 900x
func BenchmarkInboxVsBare(b *testing.B) { adaptertest.Benchmark(b, harness(b), 4) }
