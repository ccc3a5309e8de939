package sqstest_test

// The tests run against goaws, in-process, through package sqstest: one instance per test
// binary, because goaws keeps its queues in package globals, so every test uses its own queue
// names. sqstest documents goaws's limits; the tests name them where they matter.

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs/sqstest"
)

func TestMain(m *testing.M) { sqstest.Main(m) }

// awsConfig returns the AWS configuration for goaws (sqstest.AWSConfig).
var awsConfig = sqstest.AWSConfig

// goawsOptions points an SQS client at goaws and switches it to the query protocol
// (sqstest.Options).
var goawsOptions = sqstest.Options

// rawClient returns an SQS client on goaws for tests that bypass the adapter.
var rawClient = sqstest.Client

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
