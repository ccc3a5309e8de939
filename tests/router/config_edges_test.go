package router_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/adapters/nats"
	"github.com/watermill-inbox/watermill-inbox/adapters/redis"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestLocalURLDefaults: amqp, nats and redis without any URL get the local defaults the
// README lists, from the environment and from JSON.
func TestLocalURLDefaults(t *testing.T) {
	t.Setenv("INBOX_BROKER_URL", "")
	t.Setenv("INBOX_CONSUMER_GROUP", "")
	for broker, want := range map[string]string{"amqp": amqp.DefaultURL, "nats": nats.DefaultURL, "redis": redis.DefaultURL} {
		t.Setenv("INBOX_BROKER", broker)
		t.Setenv("INBOX_"+strings.ToUpper(broker)+"_URL", "")
		cfg, err := router.ConfigFromEnv()
		if err != nil || cfg.URL != want {
			t.Errorf("INBOX_BROKER=%s: %+v, %v; want URL %s", broker, cfg, err, want)
		}
		path := filepath.Join(t.TempDir(), "c.json")
		_ = os.WriteFile(path, []byte(`{"broker": "`+broker+`"}`), 0o600)
		if cfg, err := router.LoadConfig(path); err != nil || cfg.URL != want {
			t.Errorf("JSON broker %s: %+v, %v; want URL %s", broker, cfg, err, want)
		}
	}
}

// TestErrorsNameTheSettingAsGiven: a configuration error names the JSON field when the
// configuration came from JSON, the environment variable when from the environment.
func TestErrorsNameTheSettingAsGiven(t *testing.T) {
	path := filepath.Join(t.TempDir(), "c.json")
	_ = os.WriteFile(path, []byte(`{"broker": "kafka"}`), 0o600)
	_, err := router.LoadConfig(path)
	if !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), `"url"`) || strings.Contains(err.Error(), "INBOX_") {
		t.Errorf("JSON kafka without url: %v; want the JSON field \"url\" named, no environment variable", err)
	}
	_ = os.WriteFile(path, []byte(`{"broker": "pigeon"}`), 0o600)
	if _, err := router.LoadConfig(path); err == nil || !strings.Contains(err.Error(), `"broker"`) || strings.Contains(err.Error(), "INBOX_") {
		t.Errorf("JSON unknown broker: %v", err)
	}
	_ = os.WriteFile(path, []byte(`{"broker": "sqs", "url": "127.0.0.1:4100"}`), 0o600)
	if _, err := router.LoadConfig(path); err == nil || !strings.Contains(err.Error(), `"url"`) || strings.Contains(err.Error(), "INBOX_") {
		t.Errorf("JSON sqs with a bad url: %v", err)
	}
	_ = os.WriteFile(path, []byte(`{"broker": "kafka", "consumer_group": "billing"}`), 0o600)
	if _, err := router.LoadConfig(path); !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "consumer_group_prefix") {
		t.Errorf("JSON with the old consumer_group: %v", err)
	}
	t.Setenv("INBOX_CONSUMER_GROUP", "")
	t.Setenv("INBOX_BROKER", "kafka")
	t.Setenv("INBOX_BROKER_URL", "")
	if _, err := router.ConfigFromEnv(); err == nil || !strings.Contains(err.Error(), "INBOX_BROKER_URL") {
		t.Errorf("env kafka without a URL: %v", err)
	}
	if err := (router.Config{Broker: "kafka"}).Validate(); err == nil || !strings.Contains(err.Error(), "Config.URL") {
		t.Errorf("Config kafka without a URL: %v", err)
	}
	t.Setenv("INBOX_CONSUMER_GROUP", "billing")
	if _, err := router.ConfigFromEnv(); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("INBOX_CONSUMER_GROUP is refused: %v", err)
	}
}
