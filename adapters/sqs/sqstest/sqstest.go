// Package sqstest runs goaws, an SQS emulator, for a test binary (package sqsfake does the
// work; this package adds what needs package testing) and gives SQS clients the options to
// reach it. Test support only.
//
//	func TestMain(m *testing.M) { sqstest.Main(m) }
//
//	pub, err := sqs.NewPublisher(sqs.PublisherConfig{AWSConfig: sqstest.AWSConfig(),
//		OptFns: sqstest.OptFns()}, logger)
//
// See package sqsfake for goaws's limits, which tests must name where they matter.
package sqstest

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	awssqs "github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/watermill-inbox/watermill-inbox/adapters/sqs/sqstest/sqsfake"
)

// EnvEndpoint names the environment variable that points a test binary at a goaws that
// already runs (another process's): when it is set, Main starts nothing.
const EnvEndpoint = sqsfake.EnvEndpoint

// Region is the AWS region goaws is configured for.
const Region = sqsfake.Region

// QueueVisibilityTimeout is the visibility timeout, in seconds, of queues created without one.
const QueueVisibilityTimeout = sqsfake.QueueVisibilityTimeout

// Start starts goaws in this process (sqsfake.Start).
func Start() (url string, stop func(), err error) { return sqsfake.Start() }

// Endpoint returns the URL of the goaws this process uses (sqsfake.Endpoint).
func Endpoint() string { return sqsfake.Endpoint() }

// Env returns the environment a child process needs to reach this process's goaws.
func Env() []string { return sqsfake.Env() }

// AWSConfig returns an AWS configuration for goaws (sqsfake.AWSConfig).
func AWSConfig() aws.Config { return sqsfake.AWSConfig() }

// Options is an SQS client option function for goaws (sqsfake.Options).
func Options(o *awssqs.Options) { sqsfake.Options(o) }

// OptFns returns []func(*awssqs.Options){Options}.
func OptFns() []func(*awssqs.Options) { return sqsfake.OptFns() }

// Client returns a raw SQS client on goaws.
func Client() *awssqs.Client { return sqsfake.Client() }

// Main is a TestMain: it starts goaws (unless EnvEndpoint is set: then it uses that endpoint
// and starts nothing), runs the tests, stops goaws and exits with the tests' exit code.
func Main(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if u := os.Getenv(EnvEndpoint); u != "" {
		sqsfake.SetEndpoint(u)
		return m.Run()
	}
	_, stop, err := sqsfake.Start()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer stop()
	return m.Run()
}

// SetAWSEnv sets, for the duration of t, the environment under which
// config.LoadDefaultConfig (github.com/aws/aws-sdk-go-v2/config) yields a configuration fit
// for goaws: Region, dummy static credentials, no shared config files, no EC2 metadata
// lookups. Like t.Setenv, it cannot be used in parallel tests.
func SetAWSEnv(t testing.TB) {
	t.Helper()
	dir := t.TempDir()
	for k, v := range map[string]string{
		"AWS_REGION":                  Region,
		"AWS_ACCESS_KEY_ID":           "test",
		"AWS_SECRET_ACCESS_KEY":       "test",
		"AWS_SESSION_TOKEN":           "",
		"AWS_PROFILE":                 "",
		"AWS_CONFIG_FILE":             filepath.Join(dir, "none"),
		"AWS_SHARED_CREDENTIALS_FILE": filepath.Join(dir, "none"),
		"AWS_EC2_METADATA_DISABLED":   "true",
	} {
		t.Setenv(k, v)
	}
}
