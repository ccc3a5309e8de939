package amqp_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/adaptertest"
	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

// batchHarness is the matrix harness with 4 AMQP consumers of prefetch 1 per subscription: one
// router handler gets up to 4 deliveries at once, which the batched inbox gathers.
func batchHarness(t *testing.T) adaptertest.Harness {
	url := testenv.RequireAMQP(t)
	return adaptertest.Harness{
		NewBroker: func(_ *pgxpool.Pool, _ string) (*adapters.Broker, error) {
			return amqp.New(amqp.Config{URL: url, Prefetch: 1, Consumers: 4,
				QueueArguments: map[string]any{"x-expires": int32(600000)}, DeclareGroups: []string{""}}, watermill.NopLogger{})
		},
		ChildTest: "TestBatchedCrashChild",
	}
}

// TestBatchedCrashes runs the crash matrix in the batched mode (group commit) on RabbitMQ:
// SIGKILL before a batch's claim, inside a handler of a batch, and between its COMMIT and the
// acks; RabbitMQ requeues the unacked deliveries for the restarted consumer.
func TestBatchedCrashes(t *testing.T) { adaptertest.RunBatchedCrashes(t, batchHarness(t), 1) }

// TestBatchedCrashChild is the batched matrix's child (the test binary re-executed); run
// directly it returns at once.
func TestBatchedCrashChild(t *testing.T) { adaptertest.Child(t, batchHarness(t)) }
