package kafka_test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/adapters/adaptertest"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkatest"
)

// TestBatchedCrashes runs the crash matrix in the batched mode (group commit) on an in-process
// kfake cluster: one router handler consumes the matrix topic's kafkatest.DefaultPartitions
// partitions, one delivery in flight per partition, so a batch gathers up to that many.
// SIGKILL before a batch's claim, inside a handler of a batch, and between its COMMIT and the
// acks; the restarted consumer resumes at the group's committed offsets.
func TestBatchedCrashes(t *testing.T) {
	start := time.Now()
	cluster := kafkatest.NewCluster(t)
	h := matrixHarness(cluster.Addrs())
	h.ChildTest = "TestBatchedCrashChild"
	adaptertest.RunBatchedCrashes(t, h, 1)
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}

// TestBatchedCrashChild is the batched matrix's child; it connects to the parent's cluster.
// Run directly, it returns at once.
func TestBatchedCrashChild(t *testing.T) {
	var brokers []string
	if v := os.Getenv(envChildBrokers); v != "" {
		brokers = strings.Split(v, ",")
	}
	h := matrixHarness(brokers)
	h.ChildTest = "TestBatchedCrashChild"
	adaptertest.Child(t, h)
}
