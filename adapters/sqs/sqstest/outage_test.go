package sqstest_test

import (
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs/sqstest"
)

// countingClient counts HTTP requests the SDK attempts, refused connections included.
type countingClient struct {
	next awssqs.HTTPClient
	n    *atomic.Int64
}

func (c countingClient) Do(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return c.next.Do(r)
}

// startProxy serves a reverse proxy to goaws on addr ("127.0.0.1:0" for any port).
func startProxy(t *testing.T, addr string) *httptest.Server {
	t.Helper()
	target, err := url.Parse(sqstest.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	var l net.Listener
	for i := 0; ; i++ {
		if l, err = net.Listen("tcp", addr); err == nil {
			break
		}
		if i == 50 {
			t.Fatalf("listen on %s: %v", addr, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	srv := &httptest.Server{Listener: l, Config: &http.Server{Handler: httputil.NewSingleHostReverseProxy(target)}}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

// TestReceiveSurvivesBrokerOutage: the subscriber's endpoint goes away (connection refused)
// for 3 s and comes back on the same address. Meanwhile failed receives are logged and
// retried with backoff, not in a busy loop; afterwards the subscription delivers again
// without being re-created. This stands in for the suite's TestReconnect, which needs a
// command that restarts the broker (goaws runs in-process).
func TestReceiveSurvivesBrokerOutage(t *testing.T) {
	t.Parallel()
	proxy := startProxy(t, "127.0.0.1:0")
	addr := proxy.Listener.Addr().String()

	var attempts atomic.Int64
	logs := watermill.NewCaptureLogger()
	sub, err := sqs.NewSubscriber(fastSubscriberConfig(func(c *sqs.SubscriberConfig) {
		c.OptFns = append(c.OptFns, func(o *awssqs.Options) {
			o.BaseEndpoint = aws.String("http://" + addr)
			o.HTTPClient = countingClient{next: o.HTTPClient, n: &attempts}
		})
		c.ReconnectBackoffMax = time.Second
	}), logs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	topic := createQueue(t, sub, "30")
	ch := subscribe(t, sub, topic)

	proxy.Close() // waits for the long poll in progress; new connections are refused
	attempts.Store(0)
	const outage = 3 * time.Second
	time.Sleep(outage)
	during := attempts.Load()
	t.Logf("%d HTTP attempts during a %s outage", during, outage)
	// One long-poll attempt per 100 ms would already be 30; a busy loop makes thousands.
	if during < 2 || during > 30 {
		t.Errorf("%d HTTP attempts during a %s outage, want 2..30 (retries with backoff)", during, outage)
	}
	logged := false
	for _, m := range logs.Captured()[watermill.ErrorLogLevel] {
		if strings.Contains(m.Msg, "ReceiveMessage failed") {
			logged = true
		}
	}
	if !logged {
		t.Error("no error logged for the failed receives")
	}

	startProxy(t, addr)
	sent := message.NewMessage(watermill.NewUUID(), []byte("after the outage"))
	if err := newPublisher(t).Publish(topic, sent); err != nil { // straight to goaws
		t.Fatal(err)
	}
	got := receive(t, ch, 15*time.Second)
	if got.UUID != sent.UUID {
		t.Fatalf("got %q, want %q", got.UUID, sent.UUID)
	}
	got.Ack()
}
