package nats_test

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
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	natsgo "github.com/nats-io/nats.go"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/adaptertest"
	"github.com/watermill-inbox/watermill-inbox/adapters/nats"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// ackWait is the tests' AckWait: a crashed consumer's messages come back after it.
const ackWait = 2 * time.Second

// testConfig is the adapter's configuration in these tests: a short AckWait, and streams
// that expire their messages after an hour should a test leave one behind.
func testConfig(t testing.TB, group string) nats.Config {
	cfg := nats.Config{
		URL:           testenv.RequireNATS(t),
		ConsumerGroup: group,
		AckWait:       ackWait,
		Stream:        natsgo.StreamConfig{MaxAge: time.Hour},
	}
	if os.Getenv(envRecoveryDefaults) != "" {
		cfg.AckWait = 0
	}
	return cfg
}

// newBroker connects and deletes, when t ends, every stream the broker touched.
func newBroker(t testing.TB, cfg nats.Config) (*adapters.Broker, error) {
	b, err := nats.New(cfg, watermill.NopLogger{})
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
// (go test ./adapters/nats -run '^$' -bench RecoveryAfterSIGKILL).
func BenchmarkRecoveryAfterSIGKILL(b *testing.B) {
	b.Run("defaults", func(b *testing.B) {
		adaptertest.BenchmarkRecovery(b, adaptertest.Harness{
			NewBroker: func(_ *pgxpool.Pool, group string) (*adapters.Broker, error) {
				cfg := testConfig(b, group)
				cfg.AckWait = 0 // the adapter's default
				return newBroker(b, cfg)
			},
			Timeout: 2 * time.Minute,
			Env:     []string{envRecoveryDefaults + "=1"}, // the child consumer too
		})
	})
	b.Run("test timings", func(b *testing.B) { adaptertest.BenchmarkRecovery(b, harness(b)) })
}

func TestConfigValidate(t *testing.T) {
	for _, cfg := range []nats.Config{
		{ConsumerGroup: "g"},
		{URL: "nats://x"},
		{URL: "nats://x", ConsumerGroup: "a.b"},
		{URL: "nats://x", ConsumerGroup: "g", AckWait: -time.Second},
	} {
		if _, err := nats.New(cfg, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("New(%+v) = %v, want ErrInvalidConfig", cfg, err)
		}
	}
}

// TestUnmarshalerNeverFails: watermill-nats drops, unacked, a message its unmarshaler
// refuses, and JetStream redelivers it every AckWait forever. The adapter's unmarshaler turns
// a missing UUID header into an empty UUID and keeps the first of repeated headers.
func TestUnmarshalerNeverFails(t *testing.T) {
	m := natsgo.NewMsg("orders")
	m.Data = []byte("x")
	m.Header.Add("name", "OrderPlaced")
	m.Header.Add("tag", "a")
	m.Header.Add("tag", "b")
	m.Header.Set(natsgo.MsgIdHdr, "dedup-1")
	msg, err := nats.Unmarshaler{}.Unmarshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if msg.UUID != "" || string(msg.Payload) != "x" || msg.Metadata.Get("name") != "OrderPlaced" || msg.Metadata.Get("tag") != "a" {
		t.Fatalf("uuid %q payload %q metadata %v", msg.UUID, msg.Payload, msg.Metadata)
	}
	if _, ok := msg.Metadata[natsgo.MsgIdHdr]; ok {
		t.Fatal("reserved publish header kept as metadata")
	}
	m.Header.Set("_watermill_message_uuid", "order-7")
	if msg, _ := (nats.Unmarshaler{}).Unmarshal(m); msg.UUID != "order-7" {
		t.Fatalf("uuid %q", msg.UUID)
	}
}

// TestMissingUUIDIsDeadLettered publishes, with a plain JetStream client, a message without
// the `_watermill_message_uuid` header, then a normal one. The first reaches the handler's
// inbox with an empty UUID, is refused as permanent and dead-lettered without running the
// handler; the subscription goes on and the second is processed.
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

	// The stream exists once the adapter publishes to it; then a foreign producer writes.
	if err := b.Publisher.Publish(topic, message.NewMessage("order-1", []byte("first"))); err != nil {
		t.Fatal(err)
	}
	nc, err := natsgo.Connect(testenv.NATSURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		t.Fatal(err)
	}
	raw := natsgo.NewMsg(topic)
	raw.Data = []byte("no id")
	raw.Header.Set("name", "OrderPlaced")
	if _, err := js.PublishMsg(raw); err != nil {
		t.Fatal(err)
	}
	if err := b.Publisher.Publish(topic, message.NewMessage("order-2", []byte("second"))); err != nil {
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

	select {
	case m := <-dl:
		m.Ack()
		if string(m.Payload) != "no id" || !strings.Contains(m.Metadata.Get(wmmiddleware.ReasonForPoisonedKey), "empty") {
			t.Fatalf("dead letter %q, reason %q", m.Payload, m.Metadata.Get(wmmiddleware.ReasonForPoisonedKey))
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the message without a UUID was never dead-lettered")
	}
	deadline := time.Now().Add(20 * time.Second)
	for processed.Load() < 2 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if _, ran := runs.Load("no id"); ran || processed.Load() != 2 {
		t.Fatalf("handler ran for the message without a UUID: %v; processed %d, want 2", ran, processed.Load())
	}
	if s := ib.Stats(); s.InvalidKeys != 1 {
		t.Fatalf("stats %+v, want 1 invalid key", s)
	}
}

// TestUnackedMessageRedeliveredAfterClose receives a message, never acks it, and closes the
// subscriber. nats.go's auto-ack would ack it when watermill-nats gives up on it at close; with
// ManualAck it comes back, after AckWait, to the next subscriber of the group.
func TestUnackedMessageRedeliveredAfterClose(t *testing.T) {
	group := fmt.Sprintf("g_%d", time.Now().UnixNano())
	topic := fmt.Sprintf("unacked_%d", time.Now().UnixNano())
	first, err := newBroker(t, testConfig(t, group))
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

	second, err := newBroker(t, testConfig(t, group))
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
	case <-time.After(ackWait + 10*time.Second):
		t.Fatal("the unacked message was lost (acked at close)")
	}
}

// TestGroupSurvivesAMemberLeaving: two brokers of one group; the first, whose subscribe
// created the durable consumer, closes. nats.go would delete a consumer it created; the
// adapter creates it beforehand, so the remaining member keeps receiving.
func TestGroupSurvivesAMemberLeaving(t *testing.T) {
	group := fmt.Sprintf("g_%d", time.Now().UnixNano())
	topic := fmt.Sprintf("members_%d", time.Now().UnixNano())
	first, err := newBroker(t, testConfig(t, group))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := first.Subscriber.Subscribe(context.Background(), topic); err != nil {
		t.Fatal(err)
	}
	second, err := newBroker(t, testConfig(t, group))
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	msgs, err := second.Subscriber.Subscribe(context.Background(), topic)
	if err != nil {
		t.Fatal(err)
	}
	_ = first.Close()
	time.Sleep(200 * time.Millisecond)
	if err := second.Publisher.Publish(topic, message.NewMessage("order-5", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-msgs:
		m.Ack()
		if m.UUID != "order-5" {
			t.Fatalf("got %q", m.UUID)
		}
	case <-time.After(ackWait + 10*time.Second):
		t.Fatal("the group's consumer went away with its first member")
	}
}

// deleteStreams removes the streams (and their consumers) a test created.
func deleteStreams(t testing.TB, url string, names []string) {
	if len(names) == 0 {
		return
	}
	nc, err := natsgo.Connect(url)
	if err != nil {
		t.Logf("cleanup: %v", err)
		return
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		t.Logf("cleanup: %v", err)
		return
	}
	for _, name := range names {
		if err := js.DeleteStream(name); err != nil && !errors.Is(err, natsgo.ErrStreamNotFound) {
			t.Logf("cleanup: delete stream %s: %v", name, err)
		}
	}
}

// BenchmarkInboxVsBare: go test ./adapters/nats -run '^$' -bench . -benchtime 900x
func BenchmarkInboxVsBare(b *testing.B) { adaptertest.Benchmark(b, harness(b), 4) }
