// Package inboxtest connects the tests of inbox consumers and broker adapters to the real
// services they need, and re-runs the test binary as a child process for crash tests. It is
// public so that an adapter written outside this repository can run package adaptertest's
// guarantee matrix with the same rules; this repository's own tests reach it through
// internal/testenv.
//
// # Services and the -short rule
//
// PostgreSQL is found at INBOX_DATABASE_URL (default DefaultDatabaseURL), RabbitMQ at
// INBOX_AMQP_URL, NATS JetStream at INBOX_NATS_URL and Redis at INBOX_REDIS_URL. A helper that
// needs one of them (NewSchema, NewPool, RequireAMQP, RequireNATS, RequireRedis) decides what a
// test does when the service is missing:
//
//   - under go test -short it skips the test, whether or not the service runs: -short is the
//     tier that needs no service (unit tests, configuration, in-process Kafka and SQS
//     emulators);
//   - otherwise, and always when CI=true, a service that does not answer fails the test with a
//     hint on how to start it. It never skips.
//
// # Crash tests
//
// StartChild re-executes the test binary to run one test function (the child's consumer) with
// extra environment; the parent SIGKILLs it at an injected point, restarts it and checks what
// the database and the broker hold afterwards:
//
//	func TestCrash(t *testing.T) {
//		c := inboxtest.StartChild(t, "TestHelperConsumer", []string{"MY_CHILD=1"})
//		c.WaitLine(t, "READY ", 30*time.Second)
//		...
//	}
//
//	func TestHelperConsumer(t *testing.T) {
//		if os.Getenv("MY_CHILD") != "1" {
//			return // not a test of its own
//		}
//		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
//		defer stop()
//		... // start the consumer, print "READY <pid>"
//		inboxtest.WaitChildStop(t, ctx, "child consumer")
//	}
package inboxtest
