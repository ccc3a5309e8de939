package sqs

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go"
)

// ErrQueueNotFound is wrapped (together with the SDK's error) by Publish and Subscribe when
// the topic's queue does not exist. Create it with Subscriber.SubscribeInitialize, or outside
// the application (infrastructure as code).
var ErrQueueNotFound = errors.New("sqs: queue does not exist")

// queues resolves queue names to queue URLs and caches them. It is safe for concurrent use.
type queues struct {
	client *awssqs.Client

	mu   sync.Mutex
	urls map[string]string
}

func newQueues(client *awssqs.Client) *queues {
	return &queues{client: client, urls: map[string]string{}}
}

// url returns the URL of queue name, from the cache or from GetQueueUrl. Errors wrap
// ErrInvalidQueueName, ErrQueueNotFound or the SDK's error.
func (q *queues) url(ctx context.Context, name string) (string, error) {
	if err := ValidateQueueName(name); err != nil {
		return "", err
	}
	q.mu.Lock()
	u, ok := q.urls[name]
	q.mu.Unlock()
	if ok {
		return u, nil
	}
	out, err := q.client.GetQueueUrl(ctx, &awssqs.GetQueueUrlInput{QueueName: aws.String(name)})
	if err != nil {
		if isQueueMissing(err) {
			return "", fmt.Errorf("%w: %q (create it with SubscribeInitialize): %w", ErrQueueNotFound, name, err)
		}
		return "", fmt.Errorf("sqs: GetQueueUrl %q: %w", name, err)
	}
	u = aws.ToString(out.QueueUrl)
	q.remember(name, u)
	return u, nil
}

// create creates queue name with attrs (CreateQueue is idempotent in SQS when the attributes
// match) and caches its URL. For a FIFO name it adds FifoQueue=true.
func (q *queues) create(ctx context.Context, name string, attrs map[string]string) (string, error) {
	if err := ValidateQueueName(name); err != nil {
		return "", err
	}
	a := maps.Clone(attrs)
	if IsFIFO(name) {
		if a == nil {
			a = map[string]string{}
		}
		a[string(types.QueueAttributeNameFifoQueue)] = "true"
	}
	out, err := q.client.CreateQueue(ctx, &awssqs.CreateQueueInput{QueueName: aws.String(name), Attributes: a})
	if err != nil {
		return "", fmt.Errorf("sqs: CreateQueue %q: %w", name, err)
	}
	u := aws.ToString(out.QueueUrl)
	q.remember(name, u)
	return u, nil
}

func (q *queues) remember(name, u string) {
	q.mu.Lock()
	q.urls[name] = u
	q.mu.Unlock()
}

// forget drops a cached URL, after SQS reported the queue missing (it may have been deleted
// and created again under a new URL).
func (q *queues) forget(name string) {
	q.mu.Lock()
	delete(q.urls, name)
	q.mu.Unlock()
}

// isQueueMissing reports whether err is SQS's "queue does not exist" error, in the JSON
// protocol's form (QueueDoesNotExist) or the query protocol's
// (AWS.SimpleQueueService.NonExistentQueue).
func isQueueMissing(err error) bool {
	var qne *types.QueueDoesNotExist
	if errors.As(err, &qne) {
		return true
	}
	var api smithy.APIError
	if errors.As(err, &api) {
		switch api.ErrorCode() {
		case "QueueDoesNotExist", "AWS.SimpleQueueService.NonExistentQueue":
			return true
		}
	}
	return false
}
