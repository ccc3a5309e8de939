package postgres_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/adaptertest"
	"github.com/watermill-inbox/watermill-inbox/adapters/postgres"
)

var harness = adaptertest.Harness{
	NewBroker: func(pool *pgxpool.Pool, group string) (*adapters.Broker, error) {
		return postgres.New(postgres.Config{Pool: pool, ConsumerGroup: group}, watermill.NopLogger{})
	},
}

func TestGuarantees(t *testing.T)   { adaptertest.Run(t, harness) }
func TestAdapterChild(t *testing.T) { adaptertest.Child(t, harness) }

// TestPoisonCrashLoop: with no redelivery signal (every delivery counted before its handler),
// a message that SIGKILLs its consumer inside the handler every time is dead-lettered after
// MaxAttempts runs, by watermill-sql's own redelivery to the next process.
func TestPoisonCrashLoop(t *testing.T) { adaptertest.RunPoisonCrashLoop(t, harness) }

// BenchmarkRecoveryAfterSIGKILL: docs/operations.md's recovery figure
// (go test ./adapters/postgres -run '^$' -bench RecoveryAfterSIGKILL).
func BenchmarkRecoveryAfterSIGKILL(b *testing.B) { adaptertest.BenchmarkRecovery(b, harness) }

// BenchmarkInboxVsBare: go test ./adapters/postgres -run '^$' -bench . -benchtime 2000x
func BenchmarkInboxVsBare(b *testing.B) { adaptertest.Benchmark(b, harness, 1) }
