package kafka_test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/adaptertest"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkatest"
)

// matrixConfig is the adapter configuration of the guarantee matrix: the short group timeouts
// of testKafkaConfig (a SIGKILLed member is evicted within a second, so the restarted crash
// child gets its partitions, and the crashed record, at once) and a synchronous commit after
// every ack (a crash redelivers only the record in flight). Records have no key: the matrix's
// messages spread over the topic's kafkatest.DefaultPartitions partitions.
func matrixConfig(brokers []string, group string) kafka.Config {
	return kafka.Config{
		Brokers:           brokers,
		ConsumerGroup:     group,
		SessionTimeout:    time.Second,
		HeartbeatInterval: 100 * time.Millisecond,
		RebalanceTimeout:  10 * time.Second,
		FetchMaxWait:      50 * time.Millisecond,
		CommitInterval:    kafka.CommitEveryAck,
		NackResendSleep:   50 * time.Millisecond,
	}
}

// matrixHarness connects to brokers. The crash child gets their addresses in
// INBOX_KAFKA_BROKERS: the kfake cluster lives in the parent test process only.
func matrixHarness(brokers []string) adaptertest.Harness {
	return adaptertest.Harness{
		NewBroker: func(_ *pgxpool.Pool, group string) (*adapters.Broker, error) {
			return kafka.New(matrixConfig(brokers, group), watermill.NopLogger{})
		},
		Env: []string{envChildBrokers + "=" + strings.Join(brokers, ",")},
	}
}

// TestGuarantees runs the guarantee matrix on an in-process kfake cluster; its topics (a fresh
// one per case, and the dead-letter topic) are created on first use.
func TestGuarantees(t *testing.T) {
	start := time.Now()
	cluster := kafkatest.NewCluster(t)
	adaptertest.Run(t, matrixHarness(cluster.Addrs()))
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}

// TestPoisonCrashLoop: a message whose handler kills its consumer every time is dead-lettered
// after at most MaxAttempts + 1 runs, each child SIGKILLed inside the handler and the group's
// uncommitted offset bringing the message to the next child (adaptertest.RunPoisonCrashLoop),
// on an in-process kfake cluster.
func TestPoisonCrashLoop(t *testing.T) {
	cluster := kafkatest.NewCluster(t)
	adaptertest.RunPoisonCrashLoop(t, matrixHarness(cluster.Addrs()))
}

// BenchmarkRecoveryAfterSIGKILL: docs/operations.md's recovery figure, on kfake
// (go test ./adapters/kafka -run '^$' -bench RecoveryAfterSIGKILL).
func BenchmarkRecoveryAfterSIGKILL(b *testing.B) {
	cluster := kafkatest.NewCluster(b)
	adaptertest.BenchmarkRecovery(b, matrixHarness(cluster.Addrs()))
}

// TestAdapterChild is the matrix's crash child (the test binary re-executed by
// TestGuarantees); it connects to the parent's cluster and never starts one. Run directly, it
// returns at once.
func TestAdapterChild(t *testing.T) {
	var brokers []string
	if v := os.Getenv(envChildBrokers); v != "" {
		brokers = strings.Split(v, ",")
	}
	adaptertest.Child(t, matrixHarness(brokers))
}

// BenchmarkInboxVsBare: go test ./adapters/kafka -run '^$' -bench . -benchtime 1000x (on
// kfake, an in-process Kafka: the figures say how much the inbox adds, not how fast Kafka is).
func BenchmarkInboxVsBare(b *testing.B) {
	cluster := kafkatest.NewCluster(b)
	adaptertest.Benchmark(b, matrixHarness(cluster.Addrs()), 4)
}
