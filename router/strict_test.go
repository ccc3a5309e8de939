package router_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestLoadConfigRefusesAmbiguousFiles: a file that encoding/json would read one way and a
// reader another is refused with an error naming the field (or the trailing data), and
// nothing is loaded; the same content without the ambiguity loads.
func TestLoadConfigRefusesAmbiguousFiles(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct{ name, body, want string }{
		{"second object", `{"broker": "amqp"}{"broker": "nats"}`, "trailing data"},
		{"trailing garbage", `{"broker": "amqp"} garbage`, "trailing data"},
		{"trailing comma object", `{"broker": "amqp"},`, "trailing data"},
		{"duplicate key", `{"broker": "amqp", "broker": "nats"}`, `"broker" given twice`},
		{"case variant", `{"Broker": "nats"}`, `"Broker" differs from "broker" only in case`},
		{"case variant beside the field", `{"broker": "amqp", "BROKER": "nats"}`, `"BROKER" differs`},
		{"case variant of url", `{"broker": "amqp", "URL": "amqp://x:1/"}`, `"URL" differs from "url"`},
		{"unknown field", `{"broker": "amqp", "brokr": "nats"}`, `unknown field "brokr"`},
		{"a Go-only field", `{"broker": "amqp", "Batch": {"Size": 8}}`, `"Batch"`},
		{"not an object", `["amqp"]`, "want one JSON object"},
		{"old field", `{"consumer_group": "g"}`, "consumer_group_prefix"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_")+".json")
			if err := os.WriteFile(path, []byte(tc.body), 0o600); err != nil {
				t.Fatal(err)
			}
			cfg, err := router.LoadConfig(path)
			if !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("LoadConfig(%s) = %+v, %v; want ErrInvalidConfig containing %q", tc.body, cfg, err, tc.want)
			}
			if cfg.Broker != "" || cfg.URL != "" {
				t.Fatalf("LoadConfig(%s) loaded %q %q", tc.body, cfg.Broker, cfg.URL)
			}
		})
	}
	path := filepath.Join(dir, "ok.json")
	if err := os.WriteFile(path, []byte("{\"broker\": \"fake\", \"url\": \"fake://local\", \"mode\": \"immediate\"}\n\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if cfg, err := router.LoadConfig(path); err != nil || cfg.Broker != "fake" || cfg.URL != "fake://local" {
		t.Fatalf("a plain file: %+v, %v", cfg, err)
	}
}

// TestConfigFromEnvRefusesAmbiguousEnvironments: a variable whose name differs from one the
// router reads only in case, and an unknown name in the router's name spaces, are refused
// naming the variable; the variable as documented is read.
func TestConfigFromEnvRefusesAmbiguousEnvironments(t *testing.T) {
	for _, tc := range []struct{ name, value, want string }{
		{"inbox_broker", "nats", "inbox_broker differs from INBOX_BROKER only in case"},
		{"Inbox_Broker_Url", "nats://127.0.0.1:4222", "Inbox_Broker_Url differs from INBOX_BROKER_URL"},
		{"INBOX_mode", "store-then-process", "INBOX_mode differs from INBOX_MODE"},
		{"INBOX_BROKER_URI", "nats://127.0.0.1:4222", "INBOX_BROKER_URI is not read"},
		{"INBOX_BATCH_SIZ", "8", "INBOX_BATCH_SIZ is not read"},
		{"INBOX_CONSUMER_GROUP_PREFIXES", "x", "INBOX_CONSUMER_GROUP_PREFIXES is not read"},
		{"INBOX_MODES", "immediate", "INBOX_MODES is not read"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("INBOX_BROKER", "amqp")
			t.Setenv(tc.name, tc.value)
			cfg, err := router.ConfigFromEnv()
			if !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("ConfigFromEnv with %s=%s: %+v, %v; want ErrInvalidConfig containing %q", tc.name, tc.value, cfg, err, tc.want)
			}
			if cfg.Broker != "" {
				t.Fatalf("ConfigFromEnv loaded broker %q", cfg.Broker)
			}
		})
	}
	t.Setenv("INBOX_BROKER", "fake")
	t.Setenv("INBOX_BROKER_URL", "fake://local")
	if cfg, err := router.ConfigFromEnv(); err != nil || cfg.Broker != "fake" {
		t.Fatalf("the documented variables: %+v, %v", cfg, err)
	}
}
