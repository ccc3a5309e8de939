// Package inboxtest is the test kit for a service's inbox consumers: a PostgreSQL schema of
// their own per test (NewSchema), duplicate and concurrent deliveries of one message
// (Deliver, DeliverConcurrently), assertions on what the inbox recorded
// (RequireProcessedOnce, WaitProcessed), and crash tests that SIGKILL a child process at an
// injected point (StartChild). Package adaptertest's guarantee matrix for broker adapters is
// built on it.
//
// # The database and the -short rule
//
// PostgreSQL is found at INBOX_DATABASE_URL (default DefaultDatabaseURL). A helper that needs
// it (NewSchema, NewPool) decides what a test does when it is missing:
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
