package sqstest_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// createQueue creates a fresh queue through sub (SubscribeInitialize) and checks its
// visibility timeout on the broker, since the tests below depend on it.
func createQueue(t *testing.T, sub *sqs.Subscriber, wantVisibility string) string {
	t.Helper()
	q := queueName(t)
	if err := sub.SubscribeInitialize(q); err != nil {
		t.Fatalf("SubscribeInitialize(%q): %v", q, err)
	}
	ctx := context.Background()
	c := rawClient()
	u, err := c.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(q)})
	if err != nil {
		t.Fatalf("GetQueueUrl: %v", err)
	}
	attrs, err := c.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{
		QueueUrl: u.QueueUrl, AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameVisibilityTimeout},
	})
	if err != nil {
		t.Fatalf("GetQueueAttributes: %v", err)
	}
	if got := attrs.Attributes["VisibilityTimeout"]; got != wantVisibility {
		t.Fatalf("queue VisibilityTimeout = %q, want %q", got, wantVisibility)
	}
	return q
}

func subscribe(t *testing.T, sub *sqs.Subscriber, topic string) <-chan *message.Message {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatalf("Subscribe(%q): %v", topic, err)
	}
	return ch
}

func receive(t *testing.T, ch <-chan *message.Message, within time.Duration) *message.Message {
	t.Helper()
	select {
	case msg, ok := <-ch:
		if !ok {
			t.Fatal("message channel closed")
		}
		return msg
	case <-time.After(within):
		t.Fatalf("no message within %s", within)
		return nil
	}
}

func expectNothing(t *testing.T, ch <-chan *message.Message, during time.Duration) {
	t.Helper()
	select {
	case msg, ok := <-ch:
		if ok {
			msg.Ack()
			t.Fatalf("unexpected delivery of message %q", msg.UUID)
		}
	case <-time.After(during):
	}
}

// TestSlowHandlerKeepsMessageInvisible: a handler that runs for twice the queue's visibility
// timeout, with two subscribers (two Subscriber instances, as two processes would have) on
// the queue. The subscriber extends the message's visibility while the handler runs, so no
// message is handled twice, nor by both subscribers at the same time.
//
// goaws honours only the queue's VisibilityTimeout attribute (a per-receive
// VisibilityTimeout is ignored), so the queue is created with VisibilityTimeout=2 and the
// subscribers read it from the queue. Without the extension goaws makes each message visible
// again about 2 s after the receive, and the other subscriber (or the same one) receives it
// while the first handler still runs.
func TestSlowHandlerKeepsMessageInvisible(t *testing.T) {
	t.Parallel()
	const (
		visibility = 2 * time.Second
		handling   = 2 * visibility
		messages   = 3
	)
	withVisibility := func(c *sqs.SubscriberConfig) {
		c.QueueAttributes = map[string]string{"VisibilityTimeout": "2"}
		c.CloseTimeout = 10 * time.Second
	}
	subs := []*sqs.Subscriber{newSubscriber(t, withVisibility), newSubscriber(t, withVisibility)}
	topic := createQueue(t, subs[0], "2")

	type run struct {
		subscriber int
		start, end time.Time
	}
	began := time.Now()
	format := func(rs []run) string {
		var b strings.Builder
		for _, r := range rs {
			fmt.Fprintf(&b, "[subscriber %d from +%s to +%s] ", r.subscriber,
				r.start.Sub(began).Round(time.Millisecond), r.end.Sub(began).Round(time.Millisecond))
		}
		return b.String()
	}
	var (
		mu   sync.Mutex
		runs = map[string][]run{}
		wg   sync.WaitGroup
	)
	for i, sub := range subs {
		ch := subscribe(t, sub, topic)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for msg := range ch {
				go func() {
					r := run{subscriber: i, start: time.Now()}
					select {
					case <-time.After(handling):
					case <-msg.Context().Done():
					}
					r.end = time.Now()
					mu.Lock()
					runs[msg.UUID] = append(runs[msg.UUID], r)
					mu.Unlock()
					msg.Ack()
				}()
			}
		}()
	}

	pub := newPublisher(t)
	for range messages {
		if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("slow"))); err != nil {
			t.Fatalf("Publish: %v", err)
		}
	}

	// All handled once after about `handling`; then wait more than a visibility timeout to
	// catch a late second delivery.
	deadline := time.Now().Add(handling + 10*time.Second)
	for {
		mu.Lock()
		n := len(runs)
		mu.Unlock()
		if n == messages || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(visibility + time.Second)

	mu.Lock()
	defer mu.Unlock()
	if len(runs) != messages {
		t.Fatalf("handled %d distinct messages, want %d", len(runs), messages)
	}
	for id, rs := range runs {
		if len(rs) != 1 {
			t.Errorf("message %s handled %d times, want once: %s", id, len(rs), format(rs))
		}
		for i := range rs {
			for j := i + 1; j < len(rs); j++ {
				if rs[i].start.Before(rs[j].end) && rs[j].start.Before(rs[i].end) {
					t.Errorf("message %s handled concurrently by subscribers %d and %d", id, rs[i].subscriber, rs[j].subscriber)
				}
			}
		}
		if d := rs[0].end.Sub(rs[0].start); d < handling {
			t.Errorf("message %s: handler ran %s, want the full %s (context cancelled early?)", id, d, handling)
		}
	}
}

// TestMissingUUIDAttributeGivesEmptyUUID: a message sent without the _watermill_message_uuid
// attribute (here by the plain SDK) arrives with an empty UUID, not the SQS MessageId, and the
// inbox refuses that key. Other message attributes arrive as metadata; SQS system attributes
// do not.
func TestMissingUUIDAttributeGivesEmptyUUID(t *testing.T) {
	t.Parallel()
	sub := newSubscriber(t, nil)
	topic := createQueue(t, sub, "30")

	c := rawClient()
	u, err := c.GetQueueUrl(context.Background(), &awssqs.GetQueueUrlInput{QueueName: aws.String(topic)})
	if err != nil {
		t.Fatal(err)
	}
	sent, err := c.SendMessage(context.Background(), &awssqs.SendMessageInput{
		QueueUrl:    u.QueueUrl,
		MessageBody: aws.String(`{"amount":5}`),
		MessageAttributes: map[string]types.MessageAttributeValue{
			"tenant": {DataType: aws.String("String"), StringValue: aws.String("acme")},
		},
	})
	if err != nil {
		t.Fatalf("SendMessage: %v", err)
	}

	msg := receive(t, subscribe(t, sub, topic), 10*time.Second)
	defer msg.Ack()
	if msg.UUID != "" {
		t.Errorf("UUID = %q, want empty (SQS MessageId is %q)", msg.UUID, aws.ToString(sent.MessageId))
	}
	if string(msg.Payload) != `{"amount":5}` {
		t.Errorf("payload = %q", msg.Payload)
	}
	if got := msg.Metadata.Get("tenant"); got != "acme" || len(msg.Metadata) != 2 || msg.Metadata.Get(sqs.ReceiveCountKey) == "" {
		t.Errorf("metadata = %v, want only tenant=acme and the receive count", msg.Metadata)
	}
	for name := range msg.Metadata {
		if name == sqs.ReceiveCountKey { // the one system attribute copied, for Redelivery
			continue
		}
		for field := range sqs.BrokerSideFields {
			if strings.EqualFold(name, field) {
				t.Errorf("metadata carries broker-side field %q", name)
			}
		}
	}
	key, err := inbox.MessageUUID().ExtractKey(msg)
	if err != nil {
		t.Fatal(err)
	}
	var invalid *inbox.InvalidKeyError
	if err := inbox.ValidateKey("message UUID", key); !errors.As(err, &invalid) {
		t.Errorf("inbox.ValidateKey(empty UUID) = %v, want *InvalidKeyError", err)
	}
}

// TestRoundTrip: UUID, payload and metadata survive the Publisher and Subscriber; empty
// metadata values are left out (SQS refuses empty attribute values) and read back as "";
// a message published with an empty UUID arrives with an empty UUID.
func TestRoundTrip(t *testing.T) {
	t.Parallel()
	sub := newSubscriber(t, nil)
	topic := createQueue(t, sub, "30")
	pub := newPublisher(t)

	withMeta := message.NewMessage(watermill.NewUUID(), []byte("héllo ✓"))
	withMeta.Metadata.Set("payment_request_id", "pr-42")
	withMeta.Metadata.Set("empty", "")
	for i := range sqs.MaxMessageAttributes - 2 {
		withMeta.Metadata.Set("k"+string(rune('a'+i)), "v")
	}
	noUUID := message.NewMessage("", []byte("anonymous"))
	if err := pub.Publish(topic, withMeta, noUUID); err != nil {
		t.Fatalf("Publish: %v", err)
	}

	ch := subscribe(t, sub, topic)
	got := map[string]*message.Message{}
	for range 2 {
		msg := receive(t, ch, 10*time.Second)
		got[string(msg.Payload)] = msg
		msg.Ack()
	}
	m := got["héllo ✓"]
	if m == nil || m.UUID != withMeta.UUID {
		t.Fatalf("message with metadata: got %+v, want UUID %s", m, withMeta.UUID)
	}
	if m.Metadata.Get("payment_request_id") != "pr-42" || m.Metadata.Get("empty") != "" || len(m.Metadata) != sqs.MaxMessageAttributes { // 9 attributes + the receive count
		t.Errorf("metadata = %v", m.Metadata)
	}
	if a := got["anonymous"]; a == nil || a.UUID != "" {
		t.Errorf("message without UUID: got %+v, want empty UUID", a)
	}
}

// TestNackRedelivers: Nack makes the message visible again at once (ChangeMessageVisibility
// to 0), far sooner than the queue's 30 s visibility timeout; Ack deletes it.
func TestNackRedelivers(t *testing.T) {
	t.Parallel()
	sub := newSubscriber(t, nil)
	topic := createQueue(t, sub, "30")
	pub := newPublisher(t)
	sent := message.NewMessage(watermill.NewUUID(), []byte("retry me"))
	if err := pub.Publish(topic, sent); err != nil {
		t.Fatal(err)
	}
	ch := subscribe(t, sub, topic)

	first := receive(t, ch, 10*time.Second)
	nacked := time.Now()
	first.Nack()
	select {
	case <-first.Context().Done():
	case <-time.After(5 * time.Second):
		t.Error("message context not cancelled after Nack")
	}
	second := receive(t, ch, 5*time.Second)
	if second.UUID != sent.UUID || string(second.Payload) != "retry me" {
		t.Fatalf("redelivered %q %q, want %q", second.UUID, second.Payload, sent.UUID)
	}
	t.Logf("redelivered %s after Nack", time.Since(nacked).Round(time.Millisecond))
	second.Ack()
	expectNothing(t, ch, 1500*time.Millisecond)
}

// TestCloseWaitsForAckInFlight: Close cancels the context of a message the handler holds,
// waits (up to CloseTimeout) for its ack, and that ack still deletes the message.
func TestCloseWaitsForAckInFlight(t *testing.T) {
	t.Parallel()
	sub := newSubscriber(t, func(c *sqs.SubscriberConfig) {
		c.QueueAttributes = map[string]string{"VisibilityTimeout": "2"}
		c.CloseTimeout = 10 * time.Second
	})
	topic := createQueue(t, sub, "2")
	pub := newPublisher(t)
	if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("in flight"))); err != nil {
		t.Fatal(err)
	}
	ch := subscribe(t, sub, topic)
	msg := receive(t, ch, 10*time.Second)

	closed := make(chan struct{})
	go func() {
		_ = sub.Close()
		close(closed)
	}()
	select {
	case <-msg.Context().Done():
	case <-time.After(5 * time.Second):
		t.Fatal("message context not cancelled by Close")
	}
	select {
	case <-closed:
		t.Fatal("Close returned while a delivered message was neither acked nor nacked")
	case <-time.After(3 * time.Second): // longer than the 2 s visibility timeout: extension runs during Close
	}
	msg.Ack()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return after the ack")
	}
	if _, ok := <-ch; ok {
		t.Fatal("message channel still open after Close")
	}

	// Deleted: a new subscriber gets nothing, even after the visibility timeout.
	expectNothing(t, subscribe(t, newSubscriber(t, nil), topic), 3*time.Second)
}

// TestCloseReleasesUnackedMessage: a message not acked within CloseTimeout is made visible
// again at Close, so another consumer gets it at once rather than after the queue's 30 s
// visibility timeout.
func TestCloseReleasesUnackedMessage(t *testing.T) {
	t.Parallel()
	sub := newSubscriber(t, func(c *sqs.SubscriberConfig) { c.CloseTimeout = 200 * time.Millisecond })
	topic := createQueue(t, sub, "30")
	pub := newPublisher(t)
	sent := message.NewMessage(watermill.NewUUID(), []byte("abandoned"))
	if err := pub.Publish(topic, sent); err != nil {
		t.Fatal(err)
	}
	msg := receive(t, subscribe(t, sub, topic), 10*time.Second)
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}
	if msg.UUID != sent.UUID {
		t.Fatalf("got %q, want %q", msg.UUID, sent.UUID)
	}
	again := receive(t, subscribe(t, newSubscriber(t, nil), topic), 5*time.Second)
	if again.UUID != sent.UUID {
		t.Fatalf("got %q, want %q", again.UUID, sent.UUID)
	}
	again.Ack()
}

// TestFIFOQueue: on a ".fifo" queue the Publisher sets MessageGroupId (default: the topic)
// and MessageDeduplicationId (the message UUID), so a producer's retry of the same message is
// dropped by SQS, and messages arrive in publishing order.
//
// goaws gap: when a receive meets a second message of a message group that is already in
// flight, goaws marks it received (hidden for the visibility timeout) but does not return it,
// so any receive while the group is locked, or asking for more than one message, hides
// messages for 30 s. Real SQS returns several messages of one group in order. The test
// therefore receives one message at a time (MaxNumberOfMessages 1, MaxInFlight 1): the next
// receive starts only after the previous message is deleted and its group unlocked.
func TestFIFOQueue(t *testing.T) {
	t.Parallel()
	sub := newSubscriber(t, func(c *sqs.SubscriberConfig) {
		c.MaxNumberOfMessages = 1
		c.MaxInFlight = 1
	})
	topic := queueName(t) + sqs.FIFOSuffix
	if err := sub.SubscribeInitialize(topic); err != nil {
		t.Fatal(err)
	}
	pub := newPublisher(t)
	var sent []*message.Message
	for i := range 5 {
		sent = append(sent, message.NewMessage(watermill.NewUUID(), []byte{byte('a' + i)}))
	}
	if err := pub.Publish(topic, sent...); err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(topic, sent[2].Copy()); err != nil { // a producer retry
		t.Fatal(err)
	}
	ch := subscribe(t, sub, topic)
	for _, want := range sent {
		got := receive(t, ch, 10*time.Second)
		if got.UUID != want.UUID {
			t.Fatalf("got %s (%q), want %s (%q)", got.UUID, got.Payload, want.UUID, want.Payload)
		}
		got.Ack()
	}
	expectNothing(t, ch, 1500*time.Millisecond)
}
