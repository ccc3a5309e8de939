package amqp

import (
	"context"
	"sync"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
)

// consumers returns sub itself for n <= 1, else a Subscriber whose Subscribe opens n
// watermill-amqp subscriptions (n AMQP consumers, each on its own channel) of the topic and
// merges their deliveries into one channel.
func consumers(sub *wamqp.Subscriber, n int) message.Subscriber {
	if n <= 1 {
		return sub
	}
	return &multiConsumer{Subscriber: sub, n: n}
}

// multiConsumer is the Subscriber of Config.Consumers > 1.
type multiConsumer struct {
	*wamqp.Subscriber
	n int
}

// Subscribe implements message.Subscriber: n subscriptions of topic, merged. The returned
// channel is closed once every subscription's channel is closed (ctx done, or Close).
func (m *multiConsumer) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	ctx, cancel := context.WithCancel(ctx)
	ins := make([]<-chan *message.Message, 0, m.n)
	for range m.n {
		in, err := m.Subscriber.Subscribe(ctx, topic)
		if err != nil {
			cancel() // ends the subscriptions already opened
			return nil, err
		}
		ins = append(ins, in)
	}
	out := make(chan *message.Message)
	var wg sync.WaitGroup
	for _, in := range ins {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for msg := range in {
				// Each subscription waits for this message's ack or nack before the next.
				select {
				case out <- msg:
				case <-ctx.Done():
					msg.Nack() // never handed out: requeued
				}
			}
		}()
	}
	go func() {
		wg.Wait()
		cancel()
		close(out)
	}()
	return out, nil
}
