package sqs_test

// This file runs goaws (github.com/Admiral-Piett/goaws v0.4.5), an SQS emulator, in-process:
// one instance per test binary, because goaws keeps its queues in package globals. Every test
// uses its own queue names.
//
// goaws is not safe for concurrent use: its handlers read the global queue map and queue
// fields without its lock while CreateQueue and SetQueueAttributes write them, which the race
// detector reports. goawsGate serialises those writes against everything else, and emulates
// ReceiveMessage's long poll by repeating goaws's immediate receive every 20 ms (goaws itself
// polls every 100 ms) instead of holding a request inside goaws for the whole wait. The
// semantics the tests rely on (a receive returns as soon as a message is visible, or empty
// after WaitTimeSeconds; a cancelled request returns nothing) are the same.
//
// goaws's limits, which the tests name where they matter (see the notes in
// /work/shared/notes/infrastructure.md):
//   - ApproximateReceiveCount is always 1 (the adapter does not use it);
//   - a per-receive VisibilityTimeout is ignored, only the queue attribute counts (so the tests
//     leave SubscriberConfig.VisibilityTimeout at 0 and set the queue attribute);
//   - SendMessageBatch drops message attributes (the Publisher uses SendMessage);
//   - ChangeMessageVisibilityBatch is unsupported (the Subscriber uses ChangeMessageVisibility);
//   - redrive to a dead-letter queue happens one delivery late (not used here).

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	goawsconf "github.com/Admiral-Piett/goaws/app/conf"
	"github.com/Admiral-Piett/goaws/app/gosqs"
	goawsrouter "github.com/Admiral-Piett/goaws/app/router"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/schemas"
	"github.com/aws/smithy-go/transport/http/protocol/awsquery"
	"github.com/sirupsen/logrus"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
)

// goawsURL is the base URL of the in-process goaws, set by TestMain.
var goawsURL string

// goawsConfig is the goaws configuration: always passed explicitly, because without a file
// name goaws searches the whole working tree for a goaws.yaml.
const goawsConfig = `Local:
  Host: localhost
  Port: "4100"
  Region: us-east-1
  AccountId: "100010001000"
  LogToFile: false
  EnableDuplicates: true # FIFO deduplication by MessageDeduplicationId
  QueueAttributeDefaults:
    VisibilityTimeout: 30
    ReceiveMessageWaitTimeSeconds: 0
    MaximumMessageSize: 262144
`

func TestMain(m *testing.M) {
	os.Exit(runWithGoaws(m))
}

func runWithGoaws(m *testing.M) int {
	// goaws logs every message body at Info level; keep its log quiet.
	logrus.SetOutput(io.Discard)
	logrus.SetLevel(logrus.ErrorLevel)

	dir, err := os.MkdirTemp("", "goaws-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "goaws config dir:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	cfgFile := filepath.Join(dir, "goaws.yaml")
	if err := os.WriteFile(cfgFile, []byte(goawsConfig), 0o600); err != nil {
		fmt.Fprintln(os.Stderr, "goaws config:", err)
		return 1
	}
	goawsconf.LoadYamlConfig(cfgFile, "Local")

	quit := make(chan struct{})
	periodicDone := make(chan struct{})
	go func() {
		defer close(periodicDone)
		// Makes messages whose visibility timeout expired visible again.
		gosqs.PeriodicTasks(100*time.Millisecond, quit)
	}()
	srv := httptest.NewServer(&goawsGate{next: goawsrouter.New()})
	goawsURL = srv.URL

	code := m.Run()

	srv.Close()
	close(quit)
	<-periodicDone
	return code
}

// goawsGate makes goaws safe to call concurrently; see the file comment.
type goawsGate struct {
	next http.Handler
	mu   sync.RWMutex
}

func (g *goawsGate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if err := r.ParseForm(); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	switch r.Form.Get("Action") {
	case "ReceiveMessage":
		g.receive(w, r)
	case "CreateQueue", "DeleteQueue", "SetQueueAttributes", "PurgeQueue":
		g.mu.Lock()
		defer g.mu.Unlock()
		g.next.ServeHTTP(w, r)
	default:
		g.mu.RLock()
		defer g.mu.RUnlock()
		g.next.ServeHTTP(w, r)
	}
}

// receive emulates long polling: goaws answers WaitTimeSeconds=0 at once (the queues' own
// ReceiveMessageWaitTimeSeconds is 0 in goawsConfig), and the gate repeats that until a
// message is returned, the wait is over or the client goes away.
func (g *goawsGate) receive(w http.ResponseWriter, r *http.Request) {
	wait := 0
	fmt.Sscan(r.Form.Get("WaitTimeSeconds"), &wait)
	deadline := time.Now().Add(time.Duration(wait) * time.Second)
	r.Form.Set("WaitTimeSeconds", "0")
	for {
		rec := httptest.NewRecorder()
		g.mu.RLock()
		g.next.ServeHTTP(rec, r)
		g.mu.RUnlock()
		if rec.Code != http.StatusOK || bytes.Contains(rec.Body.Bytes(), []byte("<ReceiptHandle>")) || !time.Now().Before(deadline) {
			for k, v := range rec.Header() {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.Code)
			_, _ = w.Write(rec.Body.Bytes())
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// awsConfig returns an AWS configuration for goaws: a region and dummy static credentials
// (goaws does not check signatures).
func awsConfig() aws.Config {
	return aws.Config{
		Region: "us-east-1",
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: "test", SecretAccessKey: "test", Source: "goaws test"}, nil
		}),
	}
}

// goawsOptions points an SQS client at goaws and switches it to the query protocol, the only
// one goaws speaks (the SDK speaks JSON by default). The protocol must be set in an option
// function: the client constructor overwrites it in a plain Options value.
func goawsOptions(o *awssqs.Options) {
	o.BaseEndpoint = aws.String(goawsURL)
	o.Protocol = awsquery.New(schemas.AmazonSQS)
}

// rawClient returns an SQS client on goaws for tests that bypass the adapter.
func rawClient() *awssqs.Client {
	return awssqs.NewFromConfig(awsConfig(), goawsOptions)
}

// queueName returns a queue name no other test uses.
func queueName(t testing.TB) string {
	t.Helper()
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "t-" + hex.EncodeToString(b[:])
}

// testLogger logs adapter errors into the test log (Info and above).
func testLogger(t testing.TB) watermill.LoggerAdapter {
	return watermill.NewStdLoggerWithOut(testWriter{t}, false, false)
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(bytes.TrimRight(p, "\n")))
	return len(p), nil
}

// fastSubscriberConfig is a SubscriberConfig for goaws with short waits: 1 s long polls and a
// 1 s CloseTimeout. modify may change it further.
func fastSubscriberConfig(modify func(*sqs.SubscriberConfig)) sqs.SubscriberConfig {
	c := sqs.SubscriberConfig{
		AWSConfig:    awsConfig(),
		OptFns:       []func(*awssqs.Options){goawsOptions},
		WaitTime:     time.Second,
		CloseTimeout: time.Second,
	}
	if modify != nil {
		modify(&c)
	}
	return c
}

// newPublisher returns a Publisher on goaws, closed when t ends.
func newPublisher(t testing.TB) *sqs.Publisher {
	t.Helper()
	p, err := sqs.NewPublisher(sqs.PublisherConfig{
		AWSConfig: awsConfig(),
		OptFns:    []func(*awssqs.Options){goawsOptions},
	}, testLogger(t))
	if err != nil {
		t.Fatalf("NewPublisher: %v", err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// newSubscriber returns a Subscriber on goaws with fastSubscriberConfig, closed when t ends.
func newSubscriber(t testing.TB, modify func(*sqs.SubscriberConfig)) *sqs.Subscriber {
	t.Helper()
	s, err := sqs.NewSubscriber(fastSubscriberConfig(modify), testLogger(t))
	if err != nil {
		t.Fatalf("NewSubscriber: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}
