package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkatest"
	"github.com/watermill-inbox/watermill-inbox/adapters/nats"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// BenchmarkRelayVsConsumer measures, per broker, whether the outbox relay keeps up with the
// consumer it serves. A billing-like consumer (inbox, one UPDATE, one receipt returned into the
// outbox) consumes b.N payments published by 8 goroutines, while a relay (default MaxInFlight)
// forwards the receipts to the same broker. It reports the consumer's msg/s, the relay's msg/s
// over the same run (to its last receipt), the largest relay backlog sampled every 100 ms
// (Relay.Lag), and then the rate at which two fresh consumer groups drain the whole outbox:
// one publish at a time (MaxInFlight 1, the relay before pipelining) and pipelined.
//
//	go test ./tests -run '^$' -bench RelayVsConsumer -benchtime 2000x -timeout 10m
//
// Sub-benchmarks per broker: postgres, amqp, kafka (kfake, in process), nats, redis.
func BenchmarkRelayVsConsumer(b *testing.B) {
	for _, name := range []string{"postgres", "amqp", "kafka", "nats", "redis"} {
		b.Run(name, func(b *testing.B) { benchRelay(b, name) })
	}
}

func benchRelay(b *testing.B, brokerName string) {
	sch := testenv.NewSchema(b, 10)
	store := sch.Store(b)
	sch.CreateAccounts(b, 100)
	suffix := strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	payments, receipts := "bench_payments_"+suffix, "bench_receipts_"+suffix
	cfg := router.Config{Broker: brokerName}
	switch brokerName {
	case "amqp":
		cfg.URL = testenv.RequireAMQP(b)
		cfg.Settings = map[string]any{amqp.Name: &amqp.Config{Consumers: 8, PublishChannelPoolSize: 16,
			QueueArguments: map[string]any{"x-expires": int32(120000)},
			// The receipts queue exists before the first receipt, so none goes to the
			// unrouted queue; it expires with the payments queue after the run.
			DeclareGroups: []string{"billing", "receipts"}}}
	case "kafka":
		cluster := kafkatest.NewCluster(b)
		cfg.URL = strings.Join(cluster.Addrs(), ",")
	case "nats":
		cfg.URL = testenv.RequireNATS(b)
		cfg.Settings = map[string]any{nats.Name: &nats.Config{SubscribersCount: 8, AckWait: 10 * time.Second}}
	case "redis":
		cfg.URL = testenv.RequireRedis(b)
	}
	r, err := router.New(cfg, sch.Pool, watermill.NopLogger{})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = r.Close() }()
	obCfg := outbox.Config{}
	if err := outbox.InitializeSchema(context.Background(), sch.Pool, obCfg); err != nil {
		b.Fatal(err)
	}
	ob, err := outbox.New(obCfg, nil)
	if err != nil {
		b.Fatal(err)
	}
	ib, err := r.NewInbox(inbox.Config{Store: store, ConsumerName: "billing", Outbox: ob}, nil)
	if err != nil {
		b.Fatal(err)
	}
	var consumed atomic.Int64
	h, err := r.AddPublishingConsumer(ib, payments, receipts, func(msg *message.Message) ([]*message.Message, error) {
		var p struct{ Account int }
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return nil, inbox.Permanent(err)
		}
		tx, _ := pgstore.TxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 1 WHERE id = $1", p.Account); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage(uuid.NewSHA1(uuid.NameSpaceOID, []byte(msg.UUID)).String(), []byte(`{}`))}, nil
	})
	if err != nil {
		b.Fatal(err)
	}
	h.AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			out, err := next(m)
			if err == nil {
				consumed.Add(1)
			}
			return out, err
		}
	})
	go func() { _ = r.Run(context.Background()) }()
	<-r.Running()

	newRelay := func(group string, inFlight int) *outbox.Relay {
		rl, err := outbox.NewRelay(outbox.RelayConfig{Config: obCfg, Pool: sch.Pool, Publisher: r.Broker.Publisher,
			ConsumerGroup: group, MaxInFlight: inFlight, PollInterval: 20 * time.Millisecond}, benchLogger())
		if err != nil {
			b.Fatal(err)
		}
		go func() { _ = rl.Run(context.Background()) }()
		<-rl.Running()
		return rl
	}
	waitFor := func(what string, n int64, get func() int64) {
		deadline := time.Now().Add(150 * time.Second)
		for get() < n {
			if time.Now().After(deadline) {
				b.Fatalf("%s: %d of %d after 150 s", what, get(), n)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	live := newRelay("live", 0)
	defer func() { _ = live.Close() }()

	// Warm up: subscriptions joined and connections open before the clock starts.
	publishPayments(b, r.Broker.Publisher, payments, 8)
	waitFor("warm-up consumed", 8, consumed.Load)
	waitFor("warm-up relayed", 8, func() int64 { return live.Stats().Relayed })

	n := int64(b.N)
	var maxBacklog atomic.Int64
	stopSampling := make(chan struct{})
	var sampling sync.WaitGroup
	sampling.Add(1)
	go func() {
		defer sampling.Done()
		for {
			select {
			case <-stopSampling:
				return
			case <-time.After(100 * time.Millisecond):
			}
			if lag, err := live.Lag(context.Background()); err == nil && lag.Pending > maxBacklog.Load() {
				maxBacklog.Store(lag.Pending)
			}
		}
	}()
	b.ResetTimer()
	start := time.Now()
	publishPayments(b, r.Broker.Publisher, payments, int(n))
	waitFor("consumed", 8+n, consumed.Load)
	consumerT := time.Since(start)
	waitFor("relayed", 8+n, func() int64 { return live.Stats().Relayed })
	relayT := time.Since(start)
	b.StopTimer()
	close(stopSampling)
	sampling.Wait()

	drain := func(group string, inFlight int) float64 {
		rl := newRelay(group, inFlight)
		defer func() { _ = rl.Close() }()
		t0 := time.Now()
		waitFor("drained by "+group, 8+n, func() int64 { return rl.Stats().Relayed })
		return float64(8+n) / time.Since(t0).Seconds()
	}
	serial := drain("drain_serial", 1)
	pipelined := drain("drain_pipelined", 0)
	b.ReportMetric(float64(n)/consumerT.Seconds(), "consumer-msg/s")
	b.ReportMetric(float64(n)/relayT.Seconds(), "relay-msg/s")
	b.ReportMetric(float64(maxBacklog.Load()), "max-backlog")
	b.ReportMetric(serial, "drain-serial-msg/s")
	b.ReportMetric(pipelined, "drain-pipelined-msg/s")
	b.ReportMetric(0, "ns/op")
}

// publishPayments publishes n payments to topic from 8 goroutines.
func publishPayments(b *testing.B, pub message.Publisher, topic string, n int) {
	var wg sync.WaitGroup
	var next atomic.Int64
	errs := make(chan error, 8)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1)
				if i > int64(n) {
					return
				}
				m := message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf(`{"account":%d}`, i%100+1)))
				if err := pub.Publish(topic, m); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-errs:
		b.Fatal(err)
	default:
	}
}

func benchLogger() watermill.LoggerAdapter {
	if os.Getenv("RELAY_BENCH_DEBUG") != "" {
		return watermill.NewStdLogger(true, false)
	}
	return nil
}
