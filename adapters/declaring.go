package adapters

import (
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// DeclaringPublisher returns a Publisher that calls declare(topic) before the first publish to
// each topic, and publishes through pub. Use it for a broker that drops, or refuses, a message
// sent to a destination that does not exist yet (a RabbitMQ queue, an SQS queue): a dead
// letter or an outbox relay then never publishes into nothing.
//
// declare must be idempotent: concurrent first publishes to one topic may each call it. A
// topic is remembered as declared (for the life of the returned Publisher) only after declare
// succeeded; a failed declare fails that Publish call, and the next Publish to the topic calls
// declare again. Close closes pub.
func DeclaringPublisher(pub message.Publisher, declare func(topic string) error) message.Publisher {
	return &declaringPublisher{Publisher: pub, declare: declare}
}

type declaringPublisher struct {
	message.Publisher
	declare  func(topic string) error
	declared sync.Map // topic -> struct{}
}

func (p *declaringPublisher) Publish(topic string, msgs ...*message.Message) error {
	if _, ok := p.declared.Load(topic); !ok {
		if err := p.declare(topic); err != nil {
			return fmt.Errorf("declaring topic %q before publishing: %w", topic, err)
		}
		p.declared.Store(topic, struct{}{})
	}
	return p.Publisher.Publish(topic, msgs...)
}
