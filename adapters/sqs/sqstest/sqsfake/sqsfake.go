// Package sqsfake runs goaws (github.com/Admiral-Piett/goaws v0.4.5), an SQS emulator, inside
// a process, and gives SQS clients the options to reach it: the in-process SQS of the demo
// (examples/billing) and, through package sqstest, of the tests. It does not import package
// testing, so a program importing it does not link it. Never import it from production code.
//
//	url, stop, err := sqsfake.Start()
//	pub, err := sqs.NewPublisher(sqs.PublisherConfig{AWSConfig: sqsfake.AWSConfig(),
//		OptFns: sqsfake.OptFns()}, logger)
//
// One goaws per process: goaws keeps its queues in package globals, so Start refuses a
// second instance while one runs, and every test must use its own queue names. A child
// process (a test binary re-executed by a test, as the crash test of package adaptertest
// does) cannot share those globals: give it Env(), and its Main then reaches the parent's
// goaws over HTTP instead of starting its own.
//
// goaws is not safe for concurrent use: its handlers read the global queue map and queue
// fields without its lock while CreateQueue and SetQueueAttributes write them, which the race
// detector reports. A gate in front of it serialises those writes against everything else,
// and emulates ReceiveMessage's long poll by repeating goaws's immediate receive every 20 ms
// (goaws itself polls every 100 ms) instead of holding a request inside goaws for the whole
// wait. The semantics tests rely on (a receive returns as soon as a message is visible, or
// empty after WaitTimeSeconds; a cancelled request returns nothing) are the same. goaws's
// log (every message body at Info level) is discarded.
//
// goaws's limits, which tests must name where they matter (see
// the infrastructure notes beside the repository, shared/notes/infrastructure.md):
//   - ApproximateReceiveCount is always 1;
//   - a per-receive VisibilityTimeout is ignored, only the queue attribute counts (leave
//     SubscriberConfig.VisibilityTimeout at 0 and set the queue attribute "VisibilityTimeout");
//     queues created without it get QueueVisibilityTimeout;
//   - SendMessageBatch drops message attributes (the sqs Publisher uses SendMessage);
//   - ChangeMessageVisibilityBatch is unsupported (the sqs Subscriber does not use it);
//   - redrive to a dead-letter queue happens one delivery late.
package sqsfake

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"time"

	goawsconf "github.com/Admiral-Piett/goaws/app/conf"
	"github.com/Admiral-Piett/goaws/app/gosqs"
	goawsrouter "github.com/Admiral-Piett/goaws/app/router"
	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/sirupsen/logrus"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
)

// EnvEndpoint names the environment variable that points a test binary at a goaws that
// already runs (another process's): when it is set, Main starts nothing and Endpoint returns
// its value, e.g. http://127.0.0.1:41234.
const EnvEndpoint = "INBOX_SQS_ENDPOINT"

// Region is the region of goaws and of AWSConfig.
const Region = "us-east-1"

// QueueVisibilityTimeout is the visibility timeout, in seconds, of queues created without a
// VisibilityTimeout attribute.
const QueueVisibilityTimeout = 30

// goawsConfig is the goaws configuration: always passed explicitly, because without a file
// name goaws searches the whole working tree for a goaws.yaml.
var goawsConfig = fmt.Sprintf(`Local:
  Host: localhost
  Port: "4100"
  Region: %s
  AccountId: "100010001000"
  LogToFile: false
  EnableDuplicates: true # FIFO deduplication by MessageDeduplicationId
  QueueAttributeDefaults:
    VisibilityTimeout: %d
    ReceiveMessageWaitTimeSeconds: 0
    MaximumMessageSize: 262144
`, Region, QueueVisibilityTimeout)

var (
	mu       sync.Mutex
	running  bool   // an in-process goaws runs
	endpoint string // its URL, or EnvEndpoint's value once Main used it
)

// Start starts goaws in this process on a loopback port and returns its endpoint
// (http://127.0.0.1:port) and a function that stops it (and must be called before Start is
// called again). The expiry of visibility timeouts is checked every 100 ms. Start fails while
// another instance started by Start runs.
func Start() (url string, stop func(), err error) {
	mu.Lock()
	defer mu.Unlock()
	if running {
		return "", nil, errors.New("sqstest: goaws already runs in this process (it keeps its queues in package globals)")
	}

	// goaws logs every message body at Info level; keep its log quiet.
	logrus.SetOutput(io.Discard)
	logrus.SetLevel(logrus.ErrorLevel)

	dir, err := os.MkdirTemp("", "goaws-")
	if err != nil {
		return "", nil, fmt.Errorf("sqstest: goaws config dir: %w", err)
	}
	cfgFile := filepath.Join(dir, "goaws.yaml")
	if err := os.WriteFile(cfgFile, []byte(goawsConfig), 0o600); err != nil {
		_ = os.RemoveAll(dir)
		return "", nil, fmt.Errorf("sqstest: goaws config: %w", err)
	}
	goawsconf.LoadYamlConfig(cfgFile, "Local")

	quit := make(chan struct{})
	periodicDone := make(chan struct{})
	go func() {
		defer close(periodicDone)
		// Makes messages whose visibility timeout expired visible again.
		gosqs.PeriodicTasks(100*time.Millisecond, quit)
	}()
	srv := httptest.NewServer(&gate{next: goawsrouter.New()})
	running, endpoint = true, srv.URL

	var once sync.Once
	return srv.URL, func() {
		once.Do(func() {
			srv.Close()
			close(quit)
			<-periodicDone
			_ = os.RemoveAll(dir)
			mu.Lock()
			running, endpoint = false, ""
			mu.Unlock()
		})
	}, nil
}

// SetEndpoint makes this process use the goaws at u (another process's) instead of
// starting one: what package sqstest's Main does when EnvEndpoint is set.
func SetEndpoint(u string) {
	mu.Lock()
	endpoint = u
	mu.Unlock()
}

// Endpoint returns the URL of the goaws this process uses: the one Start runs, else the
// value of EnvEndpoint. It panics when there is none (Main or Start was not called and
// EnvEndpoint is unset), so that no test talks to real AWS by mistake.
func Endpoint() string {
	mu.Lock()
	u := endpoint
	mu.Unlock()
	if u == "" {
		u = os.Getenv(EnvEndpoint)
	}
	if u == "" {
		panic("sqsfake: no goaws: call sqstest.Main from TestMain, or Start, or set " + EnvEndpoint)
	}
	return u
}

// Env returns the environment a child process needs to reach this process's goaws
// (EnvEndpoint=Endpoint()), as KEY=VALUE.
func Env() []string { return []string{EnvEndpoint + "=" + Endpoint()} }

// AWSConfig returns an AWS configuration for goaws: its region and dummy static credentials
// (goaws does not check signatures).
func AWSConfig() aws.Config {
	return aws.Config{
		Region: Region,
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: "test", SecretAccessKey: "test", Source: "sqstest"}, nil
		}),
	}
}

// Options is an SQS client option function for goaws: it sets the endpoint (Endpoint(),
// read when the client is built) and the query protocol, the only one goaws speaks.
func Options(o *awssqs.Options) {
	sqs.Endpoint(Endpoint())(o)
	sqs.QueryProtocol(o)
}

// OptFns returns []func(*awssqs.Options){Options}, for PublisherConfig.OptFns,
// SubscriberConfig.OptFns and BrokerConfig.OptFns.
func OptFns() []func(*awssqs.Options) { return []func(*awssqs.Options){Options} }

// Client returns a raw SQS client on goaws, for tests that bypass the adapter.
func Client() *awssqs.Client { return awssqs.NewFromConfig(AWSConfig(), Options) }

// gate makes goaws safe to call concurrently; see the package comment.
type gate struct {
	next http.Handler
	mu   sync.RWMutex
}

func (g *gate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
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
func (g *gate) receive(w http.ResponseWriter, r *http.Request) {
	wait := 0
	_, _ = fmt.Sscan(r.Form.Get("WaitTimeSeconds"), &wait)
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
