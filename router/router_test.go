package router_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"
	goredis "github.com/redis/go-redis/v9"

	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkatest"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs/sqstest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestMain runs goaws, the SQS emulator, in-process for the "sqs" broker.
func TestMain(m *testing.M) { sqstest.Main(m) }

func TestConfigFromEnvAndFile(t *testing.T) {
	t.Setenv("INBOX_BROKER", "AMQP")
	t.Setenv("INBOX_BROKER_URL", "")
	t.Setenv("INBOX_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	cfg, err := router.ConfigFromEnv()
	if err != nil || cfg.Broker != "amqp" || cfg.URL == "" {
		t.Fatalf("ConfigFromEnv = %+v, %v", cfg, err)
	}
	t.Setenv("INBOX_BROKER", "kafka")
	t.Setenv("INBOX_BROKER_URL", "kafka://127.0.0.1:9092,127.0.0.1:9093")
	t.Setenv("INBOX_CONSUMER_GROUP_PREFIX", "billing-")
	if cfg, err := router.ConfigFromEnv(); err != nil || cfg.Broker != "kafka" || cfg.ConsumerGroupPrefix != "billing-" {
		t.Fatalf("ConfigFromEnv (kafka) = %+v, %v", cfg, err)
	}
	for _, url := range []string{"", "kafka://", "127.0.0.1:9092,", "amqp://127.0.0.1:5672"} {
		t.Setenv("INBOX_BROKER_URL", url)
		if _, err := router.ConfigFromEnv(); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Fatalf("kafka with URL %q: %v, want inbox.ErrInvalidConfig", url, err)
		}
	}
	t.Setenv("INBOX_BROKER_URL", "")
	t.Setenv("INBOX_BROKER", "nats")
	t.Setenv("INBOX_NATS_URL", "nats://127.0.0.1:4222")
	if cfg, err := router.ConfigFromEnv(); err != nil || cfg.URL != "nats://127.0.0.1:4222" {
		t.Fatalf("ConfigFromEnv = %+v, %v", cfg, err)
	}
	t.Setenv("INBOX_BROKER", "redis")
	t.Setenv("INBOX_REDIS_URL", "")
	if cfg, err := router.ConfigFromEnv(); err != nil || cfg.URL != router.DefaultRedisURL {
		t.Fatalf("redis without a URL: %+v, %v; want the local default", cfg, err)
	}
	t.Setenv("INBOX_BROKER", "carrier-pigeon")
	if _, err := router.ConfigFromEnv(); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("unknown broker: %v", err)
	}
	path := filepath.Join(t.TempDir(), "broker.json")
	_ = os.WriteFile(path, []byte(`{"broker": "postgres", "consumer_group_prefix": "billing-"}`), 0o600)
	cfg, err = router.LoadConfig(path)
	if err != nil || cfg.Broker != "postgres" || cfg.ConsumerGroupPrefix != "billing-" {
		t.Fatalf("LoadConfig = %+v, %v", cfg, err)
	}
	_ = os.WriteFile(path, []byte(`{"broker": "amqp", "ulr": "typo"}`), 0o600)
	if _, err := router.LoadConfig(path); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("unknown field: %v", err)
	}
	_ = os.WriteFile(path, []byte(`{"broker": "sqs", "url": "http://127.0.0.1:4100", "sqs_query_protocol": true}`), 0o600)
	if cfg, err = router.LoadConfig(path); err != nil || cfg.Broker != "sqs" || !cfg.SQSQueryProtocol {
		t.Fatalf("LoadConfig(sqs) = %+v, %v", cfg, err)
	}
}

func TestSQSConfigFromEnv(t *testing.T) {
	t.Setenv("INBOX_BROKER", "sqs")
	t.Setenv("INBOX_BROKER_URL", "") // AWS's endpoint for the region
	t.Setenv("INBOX_SQS_QUERY_PROTOCOL", "")
	cfg, err := router.ConfigFromEnv()
	if err != nil || cfg.Broker != "sqs" || cfg.URL != "" || cfg.SQSQueryProtocol {
		t.Fatalf("ConfigFromEnv = %+v, %v", cfg, err)
	}
	t.Setenv("INBOX_BROKER_URL", "http://127.0.0.1:4100")
	t.Setenv("INBOX_SQS_QUERY_PROTOCOL", "1")
	if cfg, err = router.ConfigFromEnv(); err != nil || cfg.URL != "http://127.0.0.1:4100" || !cfg.SQSQueryProtocol {
		t.Fatalf("ConfigFromEnv = %+v, %v", cfg, err)
	}
	t.Setenv("INBOX_SQS_QUERY_PROTOCOL", "yes please")
	if _, err := router.ConfigFromEnv(); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("INBOX_SQS_QUERY_PROTOCOL=yes please: %v", err)
	}
	t.Setenv("INBOX_SQS_QUERY_PROTOCOL", "0")
	t.Setenv("INBOX_BROKER_URL", "127.0.0.1:4100") // no scheme
	if _, err := router.ConfigFromEnv(); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("endpoint without a scheme: %v", err)
	}
}

// TestSameHandlerOnEachBroker runs one handler, unchanged, on every broker the configuration
// can name: only the Config differs.
func TestSameHandlerOnEachBroker(t *testing.T) {
	sqstest.SetAWSEnv(t)                    // region and credentials for the AWS SDK's default resolution
	kafkaCluster := kafkatest.NewCluster(t) // topics are created on first use
	for _, cfg := range []router.Config{
		{Broker: "postgres"},
		{Broker: "amqp", URL: testenv.RequireAMQP(t)},
		{Broker: "kafka", URL: "kafka://" + strings.Join(kafkaCluster.Addrs(), ",")},
		{Broker: "sqs", URL: sqstest.Endpoint(), SQSQueryProtocol: true}, // goaws, in-process
		{Broker: "nats", URL: testenv.RequireNATS(t)},
		{Broker: "redis", URL: testenv.RequireRedis(t)},
	} {
		t.Run(cfg.Broker, func(t *testing.T) {
			sch := testenv.NewSchema(t, 8)
			ctx := context.Background()
			store := sch.Store(t)
			sch.Exec(t, "CREATE TABLE ledger (message_id text PRIMARY KEY)")
			r, err := router.New(cfg, sch.Pool, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "ledger", BrokerSideFields: r.Broker.BrokerSideFields}, nil)
			if err != nil {
				t.Fatal(err)
			}
			topic := "entries_" + sch.Name
			t.Cleanup(func() { deleteTopic(t, cfg, topic) })
			_, err = r.AddConsumer(ib, topic, func(msg *message.Message) error { // the handler, identical on every broker
				tx, _ := pgstore.TxFromContext(msg.Context())
				_, err := tx.Exec(msg.Context(), "INSERT INTO ledger VALUES ($1)", msg.UUID)
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			go func() { _ = r.Run(ctx) }()
			<-r.Running()
			for _, id := range []string{"e-1", "e-2", "e-1"} {
				if err := r.Broker.Publisher.Publish(topic, message.NewMessage(id, []byte(`{}`))); err != nil {
					t.Fatal(err)
				}
			}
			deadline := time.Now().Add(20 * time.Second)
			for ib.Stats().Processed+ib.Stats().Duplicates < 3 && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
			var n int
			_ = sch.Pool.QueryRow(ctx, "SELECT count(*) FROM ledger").Scan(&n)
			if s := ib.Stats(); n != 2 || s.Processed != 2 || s.Duplicates != 1 {
				t.Fatalf("ledger rows %d, stats %+v; want 2 rows, 2 processed, 1 duplicate", n, s)
			}
		})
	}
}

// deleteTopic removes the stream a NATS or Redis run left on the server (RabbitMQ's queue is
// auto-deleted with its consumer; PostgreSQL's tables go with the schema).
func deleteTopic(t *testing.T, cfg router.Config, topic string) {
	switch cfg.Broker {
	case "nats":
		nc, err := natsgo.Connect(cfg.URL)
		if err != nil {
			t.Logf("cleanup: %v", err)
			return
		}
		defer nc.Close()
		if js, err := nc.JetStream(); err == nil {
			_ = js.DeleteStream(topic)
		}
	case "redis":
		opts, err := goredis.ParseURL(cfg.URL)
		if err != nil {
			return
		}
		c := goredis.NewClient(opts)
		defer c.Close()
		_ = c.Del(context.Background(), topic).Err()
	}
}
