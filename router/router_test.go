package router_test

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// The router's tests on the real brokers are in tests/router (and, for sqs on goaws, in the
// test module adapters/sqs/sqstest): here a fake driver, so that `go mod tidy` in a program
// that imports router downloads no broker client for router's tests (docs/modules.md).

type fakeSettings struct{ Knob int }

var opened []adapters.Spec // specs the fake driver's Open received

func init() {
	adapters.Register("fake", adapters.Driver{
		DefaultURL: "fake://local",
		URLEnv:     "INBOX_FAKE_URL",
		ValidateURL: func(url string) error {
			if !strings.HasPrefix(url, "fake://") {
				return errors.New("want fake://")
			}
			return nil
		},
		Open: func(spec adapters.Spec, _ watermill.LoggerAdapter) (*adapters.Broker, error) {
			if _, err := adapters.SettingsAs[fakeSettings]("fake", spec.Settings); err != nil {
				return nil, err
			}
			opened = append(opened, spec)
			ch := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
			return &adapters.Broker{Name: "fake", Publisher: ch, Subscriber: ch}, nil
		},
	})
}

func TestUnknownBrokerNamesTheRegisteredOnes(t *testing.T) {
	err := router.Config{Broker: "amqp"}.Validate() // its adapter is not imported here
	if !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "registered: fake") ||
		!strings.Contains(err.Error(), "adapters/all") || !strings.Contains(err.Error(), "Config.Broker") {
		t.Fatalf("Validate of an unregistered broker: %v", err)
	}
	if err := (router.Config{}).Validate(); !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), `"postgres"`) {
		t.Fatalf("the default broker, postgres, is not imported here: %v", err)
	}
}

func TestConfigFromEnvReadsTheDriversURL(t *testing.T) {
	t.Setenv("INBOX_BROKER", " Fake ")
	t.Setenv("INBOX_BROKER_URL", "")
	t.Setenv("INBOX_FAKE_URL", "")
	cfg, err := router.ConfigFromEnv()
	if err != nil || cfg.Broker != "fake" || cfg.URL != "fake://local" {
		t.Fatalf("no URL: %+v, %v; want the driver's DefaultURL", cfg, err)
	}
	t.Setenv("INBOX_FAKE_URL", "fake://from-its-variable")
	if cfg, err = router.ConfigFromEnv(); err != nil || cfg.URL != "fake://from-its-variable" {
		t.Fatalf("INBOX_FAKE_URL: %+v, %v", cfg, err)
	}
	t.Setenv("INBOX_BROKER_URL", "http://wrong")
	_, err = router.ConfigFromEnv()
	if !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "INBOX_BROKER_URL") || !strings.Contains(err.Error(), "want fake://") {
		t.Fatalf("a URL the driver refuses: %v", err)
	}
}

func TestNewBrokerPassesTheSpec(t *testing.T) {
	opened = nil
	cfg := router.Config{Broker: "fake", ConsumerGroupPrefix: "billing-", SQSQueryProtocol: true,
		Settings: map[string]any{"fake": &fakeSettings{Knob: 3}, "other": 1}}
	b, err := router.NewBroker(cfg, nil, nil)
	if err != nil || b.Name != "fake" {
		t.Fatalf("NewBroker: %v, %v", b, err)
	}
	if len(opened) != 1 {
		t.Fatalf("Open called %d times", len(opened))
	}
	s := opened[0]
	if s.URL != "fake://local" || s.ConsumerGroup != "billing-"+router.DefaultConsumerGroup || !s.QueryProtocol {
		t.Errorf("spec %+v", s)
	}
	if k, ok := s.Settings.(*fakeSettings); !ok || k.Knob != 3 {
		t.Errorf("settings %#v, want the entry of the configured broker", s.Settings)
	}
	cfg.Settings = map[string]any{"fake": "a string"}
	if _, err := router.NewBroker(cfg, nil, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("settings of the wrong type: %v", err)
	}
}

// failingSubscriber refuses every subscription, as a broker with a missing table or grant does.
type failingSubscriber struct{}

func (failingSubscriber) Subscribe(context.Context, string) (<-chan *message.Message, error) {
	return nil, errors.New("no such topic")
}
func (failingSubscriber) Close() error { return nil }

// TestFailedStartReturnsAtOnce: Watermill's Close waits its CloseTimeout (30 s) for every added
// handler that never ran; the router's Close does not, after a Run that failed to subscribe or
// without a Run; Run's error prints no stack frame with %+v.
func TestFailedStartReturnsAtOnce(t *testing.T) {
	for _, run := range []bool{true, false} {
		r, err := router.New(router.Config{Broker: "fake"}, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		r.AddConsumerHandler("h", "topic", failingSubscriber{}, func(*message.Message) error { return nil })
		start := time.Now()
		if run {
			err := r.Run(context.Background())
			if err == nil || strings.Contains(fmt.Sprintf("%+v", err), ".go:") {
				t.Errorf("Run = %+v; want the subscription's error without stack frames", err)
			}
		}
		if err := r.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if took := time.Since(start); took > 5*time.Second {
			t.Errorf("run %v: Run and Close took %v", run, took)
		}
		if run {
			continue
		}
		if err := r.Run(context.Background()); err == nil {
			t.Error("Run after Close succeeded")
		}
	}
}

// TestLinksNoBrokerClient: package router, and its tests, link no broker client, SDK,
// emulator or peer library; a program gets those only from the adapters it imports.
func TestLinksNoBrokerClient(t *testing.T) {
	for _, args := range [][]string{{"list", "-deps", "."}, {"list", "-test", "-deps", "."}} {
		out, err := exec.Command("go", args...).CombinedOutput()
		if err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			for _, heavy := range []string{"aws-sdk-go-v2", "smithy-go", "IBM/sarama", "franz-go", "nats-io", "go-redis",
				"rabbitmq", "watermill-amqp", "watermill-kafka", "watermill-nats", "watermill-redisstream", "watermill-sql",
				"goaws", "riverqueue", "golang.org/x/perf", "watermill-inbox/adapters/"} {
				if strings.Contains(dep, heavy) {
					t.Errorf("go %s lists %s", strings.Join(args, " "), dep)
				}
			}
		}
	}
}
