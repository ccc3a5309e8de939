package router_test

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestBrokerURLPasswordNeverPrinted: for every broker configured by URL, a URL with a
// password and a bad port fails in Validate or NewBroker without printing the password, in
// the error or in any log line (trace level).
func TestBrokerURLPasswordNeverPrinted(t *testing.T) {
	for broker, u := range map[string]string{
		"amqp":  "amqp://user:secret@127.0.0.1:badport/",
		"nats":  "nats://user:secret@127.0.0.1:badport",
		"redis": "redis://user:secret@127.0.0.1:badport/0",
		"kafka": "kafka://user:secret@127.0.0.1:badport",
		"sqs":   "http://user:secret@127.0.0.1:badport",
	} {
		t.Run(broker, func(t *testing.T) {
			var logs strings.Builder
			cfg := router.Config{Broker: broker, URL: u, ConsumerGroupPrefix: "g"}
			err := cfg.Validate()
			if err == nil {
				_, err = router.NewBroker(cfg, nil, watermill.NewStdLoggerWithOut(&logs, true, true))
			}
			if err == nil {
				t.Fatalf("%s with a bad port accepted", u)
			}
			if strings.Contains(err.Error(), "secret") || strings.Contains(logs.String(), "secret") {
				t.Fatalf("password printed:\nerror: %v\nlogs:\n%s", err, logs.String())
			}
		})
	}
}
