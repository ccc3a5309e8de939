package sqstest_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/adaptertest"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs/sqstest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// matrixVisibility is the VisibilityTimeout attribute of the matrix's queues. goaws honours
// only the queue attribute. In the crash test, the first child dies holding messages it
// received and did not ack (the one committed before the crash, and the ones received in the
// same batch); they become visible again for the second child after this long, well within
// the matrix's 30 s waits. The subscriber extends a handled message's visibility every
// third of it (1 s).
const matrixVisibility = "3"

// brokerConfig is the broker the matrix and the broker tests use: goaws (this process's, or
// the parent's through sqstest.EnvEndpoint in the crash test's child, whose TestMain then
// starts no goaws of its own), 1 s long polls, and queues created with a short visibility
// timeout.
func brokerConfig() sqs.BrokerConfig {
	return sqs.BrokerConfig{
		AWSConfig:       sqstest.AWSConfig(),
		OptFns:          sqstest.OptFns(),
		QueueAttributes: map[string]string{"VisibilityTimeout": matrixVisibility},
		WaitTime:        time.Second,
		CloseTimeout:    2 * time.Second,
	}
}

func harness() adaptertest.Harness {
	return adaptertest.Harness{
		NewBroker: func(_ *pgxpool.Pool, _ string) (*adapters.Broker, error) {
			// The consumer group is the queue: the topic names it.
			return sqs.New(brokerConfig(), watermill.NopLogger{})
		},
		// The crash test's children reach this process's goaws over HTTP.
		Env: sqstest.Env(),
	}
}

func TestGuarantees(t *testing.T)   { adaptertest.Run(t, harness()) }
func TestAdapterChild(t *testing.T) { adaptertest.Child(t, harness()) }

// TestBrokerPublishCreatesQueue publishes to a topic nobody subscribed to yet: the plain
// Publisher would fail with ErrQueueNotFound; the broker's creates the queue, with the
// configured attributes, and a subscriber that comes later gets the message.
func TestBrokerPublishCreatesQueue(t *testing.T) {
	t.Parallel()
	b, err := sqs.New(brokerConfig(), testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	topic := queueName(t)
	if err := b.Publisher.Publish(topic, message.NewMessage("dead-letter-1", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	if got := queueVisibility(t, topic); got != matrixVisibility {
		t.Fatalf("created queue has VisibilityTimeout %q, want %q", got, matrixVisibility)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := b.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	m := receive(t, msgs, 10*time.Second)
	m.Ack()
	if m.UUID != "dead-letter-1" {
		t.Fatalf("got %q", m.UUID)
	}
}

// TestBrokerSubscribeCreatesQueue subscribes to a topic whose queue does not exist (the plain
// Subscriber fails with ErrQueueNotFound), and uses a queue that exists with other attributes
// as it is, instead of failing on CreateQueue's QueueNameExists.
func TestBrokerSubscribeCreatesQueue(t *testing.T) {
	t.Parallel()
	b, err := sqs.New(brokerConfig(), testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	fresh := queueName(t)
	if _, err := b.Subscriber.Subscribe(ctx, fresh); err != nil {
		t.Fatalf("Subscribe to a missing queue: %v", err)
	}
	if got := queueVisibility(t, fresh); got != matrixVisibility {
		t.Fatalf("created queue has VisibilityTimeout %q, want %q", got, matrixVisibility)
	}

	existing := queueName(t)
	if _, err := rawClient().CreateQueue(ctx, &awssqs.CreateQueueInput{
		QueueName: aws.String(existing), Attributes: map[string]string{"VisibilityTimeout": "7"},
	}); err != nil {
		t.Fatal(err)
	}
	msgs, err := b.Subscriber.Subscribe(ctx, existing)
	if err != nil {
		t.Fatalf("Subscribe to an existing queue: %v", err)
	}
	if err := b.Publisher.Publish(existing, message.NewMessage("m-1", []byte("x"))); err != nil {
		t.Fatal(err)
	}
	receive(t, msgs, 10*time.Second).Ack()
	if got := queueVisibility(t, existing); got != "7" {
		t.Fatalf("existing queue's VisibilityTimeout became %q, want it untouched (7)", got)
	}

	if err := b.Subscriber.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Subscriber.Subscribe(ctx, queueName(t)); !errors.Is(err, sqs.ErrSubscriberClosed) {
		t.Fatalf("Subscribe after Close: %v, want ErrSubscriberClosed", err)
	}
}

// TestNewBrokerInvalidConfig: a configuration error wraps both error values.
func TestNewBrokerInvalidConfig(t *testing.T) {
	_, err := sqs.New(sqs.BrokerConfig{}, nil) // no region
	if !errors.Is(err, sqs.ErrInvalidConfig) || !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("New without a region: %v, want ErrInvalidConfig (both packages')", err)
	}
}

func queueVisibility(t *testing.T, queue string) string {
	t.Helper()
	ctx := context.Background()
	c := rawClient()
	u, err := c.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(queue)})
	if err != nil {
		t.Fatalf("GetQueueUrl(%q): %v", queue, err)
	}
	attrs, err := c.GetQueueAttributes(ctx, &awssqs.GetQueueAttributesInput{
		QueueUrl: u.QueueUrl, AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameVisibilityTimeout},
	})
	if err != nil {
		t.Fatalf("GetQueueAttributes(%q): %v", queue, err)
	}
	return attrs.Attributes["VisibilityTimeout"]
}

// BenchmarkInboxVsBare: go test ./adapters/sqs -run '^$' -bench . -benchtime 500x (on goaws,
// an emulator: the figures say how much the inbox adds, not how fast SQS is).
func BenchmarkInboxVsBare(b *testing.B) { adaptertest.Benchmark(b, harness(), 4) }

// TestPoisonCrashLoop: a message whose handler kills its consumer every time is dead-lettered
// after at most MaxAttempts + 1 runs, each child SIGKILLed inside the handler and SQS's
// visibility timeout bringing the message to the next (adaptertest.RunPoisonCrashLoop).
func TestPoisonCrashLoop(t *testing.T) { adaptertest.RunPoisonCrashLoop(t, harness()) }
