package adaptertest

import (
	"context"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/adapters"
)

// CleanupTopics wraps b's Publisher and Subscriber so that they record every topic they
// publish to or subscribe to, and calls remove with those topics (in no particular order)
// when t ends, e.g. to delete the streams a test created.
func CleanupTopics(t testing.TB, b *adapters.Broker, remove func(topics []string)) {
	rec := &recorder{}
	b.Publisher = &recordingPublisher{Publisher: b.Publisher, rec: rec}
	b.Subscriber = &recordingSubscriber{Subscriber: b.Subscriber, rec: rec}
	t.Cleanup(func() { remove(rec.list()) })
}

type recorder struct {
	mu     sync.Mutex
	topics map[string]bool
}

func (r *recorder) add(topic string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.topics == nil {
		r.topics = map[string]bool{}
	}
	r.topics[topic] = true
}

func (r *recorder) list() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for t := range r.topics {
		out = append(out, t)
	}
	return out
}

type recordingPublisher struct {
	message.Publisher
	rec *recorder
}

func (p *recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.rec.add(topic)
	return p.Publisher.Publish(topic, msgs...)
}

type recordingSubscriber struct {
	message.Subscriber
	rec *recorder
}

func (s *recordingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	s.rec.add(topic)
	return s.Subscriber.Subscribe(ctx, topic)
}
