package sqs

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
)

// Subscriber receives messages from SQS queues; the topic is the queue name. It implements
// message.Subscriber and message.SubscribeInitializer and is safe for concurrent use.
//
// Per message: Ack deletes it (DeleteMessage); Nack makes it visible again at once
// (ChangeMessageVisibility to 0 s), so SQS redelivers it; while it is unacknowledged its
// visibility is extended every third of the visibility timeout. Delivery is at least once:
// SQS standard queues may deliver a message twice and out of order, which is what the inbox
// middleware is for.
type Subscriber struct {
	config SubscriberConfig
	logger watermill.LoggerAdapter
	client *awssqs.Client
	queues *queues

	closing   chan struct{}
	closeOnce sync.Once
	mu        sync.Mutex // guards closed and the Add calls of subs against Close's Wait
	closed    bool
	subs      sync.WaitGroup // one per running subscription
}

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// NewSubscriber fills in config's defaults, validates it and returns a Subscriber. A nil
// logger discards logs. The error wraps ErrInvalidConfig. No network call is made.
func NewSubscriber(config SubscriberConfig, logger watermill.LoggerAdapter) (*Subscriber, error) {
	config.setDefaults()
	if err := config.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	client := awssqs.NewFromConfig(config.AWSConfig, config.OptFns...)
	return &Subscriber{
		config:  config,
		logger:  logger,
		client:  client,
		queues:  newQueues(client),
		closing: make(chan struct{}),
	}, nil
}

// SubscribeInitialize creates the queue named topic with CreateQueue and
// SubscriberConfig.QueueAttributes (plus FifoQueue=true for a ".fifo" name). Creating a queue
// that exists with the same attributes succeeds (SQS CreateQueue is idempotent); with other
// attributes SQS answers QueueNameExists, returned wrapped. Errors also wrap
// ErrSubscriberClosed or ErrInvalidQueueName. The call is bounded by RequestTimeout.
func (s *Subscriber) SubscribeInitialize(topic string) error {
	if s.isClosed() {
		return ErrSubscriberClosed
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.config.RequestTimeout)
	defer cancel()
	_, err := s.queues.create(ctx, topic, s.config.QueueAttributes)
	return err
}

// Subscribe resolves the queue URL of topic (GetQueueUrl; it does not create the queue),
// determines the visibility timeout (SubscriberConfig.VisibilityTimeout, or the queue's
// VisibilityTimeout attribute) and starts receiving with long polling. It returns an
// unbuffered channel of messages that is closed after ctx is cancelled or Close is called and
// every message of the subscription has been acked, nacked or released (see CloseTimeout).
// Each message's Context derives from ctx and is cancelled after its Ack or Nack, and on
// Close.
//
// Errors wrap ErrSubscriberClosed, ErrInvalidQueueName, ErrQueueNotFound or the SDK's error
// of GetQueueUrl / GetQueueAttributes. Failures after Subscribe returned (broker unreachable,
// queue deleted) are logged and retried with backoff; they never close the channel.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if s.isClosed() {
		return nil, ErrSubscriberClosed
	}
	queueURL, err := s.queues.url(ctx, topic)
	if err != nil {
		return nil, err
	}
	visibility := s.config.VisibilityTimeout
	if visibility == 0 {
		if visibility, err = s.queueVisibilityTimeout(ctx, topic, queueURL); err != nil {
			return nil, err
		}
	}

	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrSubscriberClosed
	}
	s.subs.Add(1)
	s.mu.Unlock()

	subCtx, cancel := context.WithCancel(ctx)
	sub := &subscription{
		s:          s,
		topic:      topic,
		queueURL:   queueURL,
		visibility: visibility,
		ctx:        subCtx,
		out:        make(chan *message.Message),
		slots:      make(chan struct{}, s.config.MaxInFlight),
		logger: s.logger.With(watermill.LogFields{
			"topic":    topic,
			"provider": "sqs",
		}),
	}
	if visibility < time.Second {
		sub.logger.Info("Queue visibility timeout is below 1s: visibility of slow messages cannot be extended", watermill.LogFields{
			"visibility_timeout": visibility.String(),
		})
	}
	go func() {
		select {
		case <-s.closing:
		case <-subCtx.Done():
		}
		cancel()
	}()
	go func() {
		defer s.subs.Done()
		sub.run()
	}()
	return sub.out, nil
}

// queueVisibilityTimeout reads the VisibilityTimeout attribute of the queue (whole seconds).
func (s *Subscriber) queueVisibilityTimeout(ctx context.Context, topic, queueURL string) (time.Duration, error) {
	out, err := s.client.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{
		QueueUrl:       aws.String(queueURL),
		AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameVisibilityTimeout},
	})
	if err != nil {
		if isQueueMissing(err) {
			s.queues.forget(topic)
			return 0, fmt.Errorf("%w: %q: GetQueueAttributes: %w", ErrQueueNotFound, topic, err)
		}
		return 0, fmt.Errorf("sqs: GetQueueAttributes VisibilityTimeout of %q: %w", topic, err)
	}
	raw := out.Attributes[string(types.QueueAttributeNameVisibilityTimeout)]
	secs, err := strconv.Atoi(raw)
	if err != nil || secs < 0 {
		return 0, fmt.Errorf("sqs: queue %q has VisibilityTimeout %q, want whole seconds: set SubscriberConfig.VisibilityTimeout", topic, raw)
	}
	return time.Duration(secs) * time.Second, nil
}

// Close stops every subscription from receiving (a ReceiveMessage call in progress gets
// 0.5 s to complete, so messages SQS already picked for it are handed back at once instead of
// staying hidden for a visibility timeout), cancels the context of every message in flight, waits up to CloseTimeout for messages already handed to a handler to be acked or
// nacked (acks still delete), makes the others visible again, closes every message channel
// and releases idle HTTP connections. It returns nil; calling it again waits for the first
// call's work and returns nil.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.closeOnce.Do(func() { close(s.closing) })
	s.subs.Wait()
	if c, ok := s.client.Options().HTTPClient.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
	return nil
}

func (s *Subscriber) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// subscription is one Subscribe call: a receive loop and one goroutine per message in flight.
type subscription struct {
	s          *Subscriber
	topic      string
	queueURL   string
	visibility time.Duration
	ctx        context.Context // cancelled by the Subscribe context or Close
	out        chan *message.Message
	slots      chan struct{} // one token per message in flight, capacity MaxInFlight
	logger     watermill.LoggerAdapter
	workers    sync.WaitGroup
}

// run receives until the subscription's context ends, then waits for the message goroutines
// and closes the output channel.
func (sub *subscription) run() {
	defer func() {
		sub.workers.Wait()
		close(sub.out)
		sub.logger.Debug("SQS subscription closed", nil)
	}()
	cfg := sub.s.config
	backoff := time.Duration(0)
	for {
		if sub.ctx.Err() != nil {
			return
		}
		// Take one slot (block until a message in flight finishes), then any free ones, up to
		// MaxNumberOfMessages: a receive never asks for more than can be processed.
		select {
		case sub.slots <- struct{}{}:
		case <-sub.ctx.Done():
			return
		}
		n := int32(1)
	fill:
		for n < cfg.MaxNumberOfMessages {
			select {
			case sub.slots <- struct{}{}:
				n++
			default:
				break fill
			}
		}

		in := &awssqs.ReceiveMessageInput{
			QueueUrl:              aws.String(sub.queueURL),
			MaxNumberOfMessages:   n,
			WaitTimeSeconds:       ceilSeconds(cfg.WaitTime),
			MessageAttributeNames: []string{"All"},
			// The receive count and, on FIFO queues, the sequence number feed Redelivery.
			MessageSystemAttributeNames: []types.MessageSystemAttributeName{
				types.MessageSystemAttributeNameApproximateReceiveCount,
				types.MessageSystemAttributeNameSequenceNumber,
			},
		}
		if cfg.VisibilityTimeout > 0 {
			in.VisibilityTimeout = ceilSeconds(cfg.VisibilityTimeout)
		}
		out, err := sub.receive(in)
		if err != nil {
			sub.release(int(n))
			if sub.ctx.Err() != nil {
				return
			}
			backoff = nextBackoff(backoff, cfg.ReconnectBackoffInitial, cfg.ReconnectBackoffMax)
			sub.logger.Error("SQS ReceiveMessage failed, retrying after backoff", err, watermill.LogFields{
				"backoff": backoff.String(),
			})
			if !sleep(sub.ctx, backoff) {
				return
			}
			continue
		}
		backoff = 0
		if extra := len(out.Messages) - int(n); extra > 0 {
			// SQS never returns more than asked; should an endpoint do so, keep the count right.
			for range extra {
				sub.slots <- struct{}{}
			}
		} else {
			sub.release(-extra)
		}
		for _, m := range out.Messages {
			sub.workers.Add(1)
			go sub.handle(m)
		}
	}
}

// receiveGrace is how long a ReceiveMessage call in progress may still complete after the
// subscription ends. SQS hides the messages it picks for a receive even when the caller has
// gone away, so aborting at once would hide them for a whole visibility timeout; a receive
// that completes in the grace hands its messages back at once instead. On an empty queue
// the long poll is aborted after the grace, which is what Close waits for at most.
const receiveGrace = 500 * time.Millisecond

// receive calls ReceiveMessage on a context that ends receiveGrace after the subscription's.
func (sub *subscription) receive(in *awssqs.ReceiveMessageInput) (*awssqs.ReceiveMessageOutput, error) {
	ctx, cancel := context.WithCancel(context.WithoutCancel(sub.ctx))
	defer cancel()
	stop := context.AfterFunc(sub.ctx, func() {
		t := time.NewTimer(receiveGrace)
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-ctx.Done():
		}
	})
	defer stop()
	return sub.s.client.ReceiveMessage(ctx, in)
}

func (sub *subscription) release(n int) {
	for range n {
		<-sub.slots
	}
}

// handle delivers one received message and settles it: delete on Ack, visibility 0 on Nack
// or when it cannot be delivered, extending its visibility meanwhile.
func (sub *subscription) handle(m types.Message) {
	defer sub.workers.Done()
	defer sub.release(1)

	msg := unmarshal(m)
	fields := watermill.LogFields{
		"message_uuid":   msg.UUID,
		"sqs_message_id": aws.ToString(m.MessageId),
	}
	msgCtx, cancelMsg := context.WithCancel(sub.ctx)
	defer cancelMsg()
	msg.SetContext(msgCtx)

	stopExtending := sub.extendVisibility(aws.ToString(m.ReceiptHandle), fields)

	// A message received while the subscription was ending is not delivered.
	sent := false
	if sub.ctx.Err() == nil {
		select {
		case sub.out <- msg:
			sent = true
		case <-sub.ctx.Done():
		}
	}
	if !sent {
		stopExtending()
		sub.changeVisibility(m, 0, fields, "release undelivered message")
		return
	}

	acked, why := false, "nack"
	select {
	case <-msg.Acked():
		acked = true
	case <-msg.Nacked():
	case <-sub.ctx.Done():
		// Closing: msgCtx is cancelled with sub.ctx; give the handler CloseTimeout to finish.
		timer := time.NewTimer(sub.s.config.CloseTimeout)
		select {
		case <-msg.Acked():
			acked = true
		case <-msg.Nacked():
		case <-timer.C:
			why = "not settled within CloseTimeout"
			sub.logger.Info("Message neither acked nor nacked within CloseTimeout, making it visible again", fields)
		}
		timer.Stop()
	}
	stopExtending()
	cancelMsg()
	if acked {
		sub.delete(m, fields)
		return
	}
	sub.changeVisibility(m, 0, fields, why)
}

// extendVisibility keeps the message invisible while it is handled: every third of the
// visibility timeout it sets the timeout again (ChangeMessageVisibility), so the message stays
// hidden for a full timeout after each extension. The returned function stops the extension
// and waits until no extension call is in progress, so none can race the final delete or
// release.
func (sub *subscription) extendVisibility(receiptHandle string, fields watermill.LogFields) (stop func()) {
	if sub.visibility < time.Second {
		return func() {}
	}
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		ticker := time.NewTicker(sub.visibility / 3)
		defer ticker.Stop()
		seconds := ceilSeconds(sub.visibility)
		for {
			select {
			case <-done:
				return
			case <-ticker.C:
			}
			ctx, cancel := context.WithTimeout(context.Background(), sub.visibility/3)
			_, err := sub.s.client.ChangeMessageVisibility(ctx, &awssqs.ChangeMessageVisibilityInput{
				QueueUrl:          aws.String(sub.queueURL),
				ReceiptHandle:     aws.String(receiptHandle),
				VisibilityTimeout: seconds,
			})
			cancel()
			if err != nil {
				sub.logger.Error("SQS ChangeMessageVisibility (extension) failed; the message may be delivered again", err, fields)
			} else {
				sub.logger.Trace("Extended SQS message visibility", fields)
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() { close(done) })
		<-finished
	}
}

// delete removes an acked message (DeleteMessage), on a context detached from the
// subscription so an ack during Close still deletes. A failure is logged: SQS then delivers
// the message again after its visibility timeout, which the inbox turns into a duplicate.
func (sub *subscription) delete(m types.Message, fields watermill.LogFields) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(sub.ctx), sub.s.config.RequestTimeout)
	defer cancel()
	_, err := sub.s.client.DeleteMessage(ctx, &awssqs.DeleteMessageInput{
		QueueUrl:      aws.String(sub.queueURL),
		ReceiptHandle: m.ReceiptHandle,
	})
	if err != nil {
		sub.logger.Error("SQS DeleteMessage after ack failed; the message will be delivered again", err, fields)
		return
	}
	sub.logger.Trace("Message acked and deleted from SQS", fields)
}

// changeVisibility sets the message's visibility timeout (0: visible at once), on a context
// detached from the subscription. A failure is logged: the message then becomes visible when
// its current timeout expires.
func (sub *subscription) changeVisibility(m types.Message, seconds int32, fields watermill.LogFields, why string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(sub.ctx), sub.s.config.RequestTimeout)
	defer cancel()
	_, err := sub.s.client.ChangeMessageVisibility(ctx, &awssqs.ChangeMessageVisibilityInput{
		QueueUrl:          aws.String(sub.queueURL),
		ReceiptHandle:     m.ReceiptHandle,
		VisibilityTimeout: seconds,
	})
	if err != nil {
		sub.logger.Error("SQS ChangeMessageVisibility ("+why+") failed; the message becomes visible when its visibility timeout expires", err, fields)
		return
	}
	sub.logger.Trace("SQS message visibility changed ("+why+")", fields)
}

// nextBackoff doubles prev (starting at initial), caps it at limit and adds up to 25% jitter.
func nextBackoff(prev, initial, limit time.Duration) time.Duration {
	d := initial
	if prev > 0 {
		d = min(prev*2, limit)
	}
	if d <= 0 {
		return 0
	}
	return min(d+time.Duration(rand.Int64N(int64(d)/4+1)), limit)
}

// sleep waits for d or until ctx ends; it reports whether the whole d elapsed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
