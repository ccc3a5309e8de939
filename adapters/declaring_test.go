package adapters_test

import (
	"errors"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/adapters"
)

type recordingPublisher struct {
	mu     sync.Mutex
	topics []string
	closed bool
}

func (p *recordingPublisher) Publish(topic string, _ ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.topics = append(p.topics, topic)
	return nil
}

func (p *recordingPublisher) Close() error { p.closed = true; return nil }

// TestDeclaringPublisher: declare runs before the first publish to each topic and not again
// after it succeeded; a failed declare fails the publish, sends nothing, and is retried.
func TestDeclaringPublisher(t *testing.T) {
	inner := &recordingPublisher{}
	declared := map[string]int{}
	fail := true
	pub := adapters.DeclaringPublisher(inner, func(topic string) error {
		declared[topic]++
		if topic == "flaky" && fail {
			fail = false
			return errors.New("broker unreachable")
		}
		return nil
	})
	msg := message.NewMessage("m-1", nil)
	for _, topic := range []string{"a", "a", "b", "a"} {
		if err := pub.Publish(topic, msg); err != nil {
			t.Fatal(err)
		}
	}
	if declared["a"] != 1 || declared["b"] != 1 {
		t.Fatalf("declare calls %v, want one per topic", declared)
	}
	if err := pub.Publish("flaky", msg); err == nil {
		t.Fatal("publish after a failed declare succeeded")
	}
	if len(inner.topics) != 4 {
		t.Fatalf("published to %v after a failed declare", inner.topics)
	}
	if err := pub.Publish("flaky", msg); err != nil || declared["flaky"] != 2 {
		t.Fatalf("second publish: %v, declare calls %d; want the declare retried", err, declared["flaky"])
	}
	if err := pub.Close(); err != nil || !inner.closed {
		t.Fatalf("Close = %v, inner closed %v", err, inner.closed)
	}
}
