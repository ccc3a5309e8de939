package router_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/adapters/redis"
	"github.com/watermill-inbox/watermill-inbox/internal/routertest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/router"
)

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
	if cfg, err := router.ConfigFromEnv(); err != nil || cfg.URL != redis.DefaultURL {
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
// can name: only the Config differs (sqs: on goaws, in the test module adapters/sqs/sqstest).
func TestSameHandlerOnEachBroker(t *testing.T) {
	for _, cfg := range brokerConfigs(t) {
		t.Run(cfg.Broker, func(t *testing.T) { routertest.SameHandler(t, cfg) })
	}
}
