// Package kafkatest runs an in-process Kafka cluster for tests, on package kafkafake (which a
// program may link; this package imports package testing and belongs in tests only): kfake
// (github.com/twmb/franz-go/pkg/kfake), a Kafka-protocol broker written in Go, with three
// brokers and seeded topics. It needs no Kafka installation and no network beyond loopback.
// Tests never skip: a cluster that cannot start fails the test.
//
// kfake speaks the protocol sarama v1.61.1 needs for watermill-kafka v3 (produce, fetch,
// consumer groups, offset commit and fetch). sarama before v1.61 fails against it for
// protocol versions >= 2.4 (OffsetFetch v6).
package kafkatest

import (
	"slices"
	"testing"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkafake"
)

// Constants and helpers of package kafkafake, the testing-free half of this package.
const (
	NumBrokers        = kafkafake.NumBrokers
	DefaultPartitions = kafkafake.DefaultPartitions
	MinSessionTimeout = kafkafake.MinSessionTimeout
)

// Topic is a topic to create with the cluster (kafkafake.Topic).
type Topic = kafkafake.Topic

// Start is kafkafake.Start.
func Start(topics ...Topic) (addrs []string, stop func(), err error) {
	return kafkafake.Start(topics...)
}

// KeyForPartition is kafkafake.KeyForPartition.
func KeyForPartition(partition, partitions int32) string {
	return kafkafake.KeyForPartition(partition, partitions)
}

// TryCommittedOffsets is CommittedOffsets returning its error, for polling while the group
// rebalances (kafkafake.TryCommittedOffsets).
func TryCommittedOffsets(addrs []string, group, topic string) (map[int32]int64, error) {
	return kafkafake.TryCommittedOffsets(addrs, group, topic)
}

// Cluster is a running kfake cluster. It is closed when the test that created it ends.
type Cluster struct {
	*kfake.Cluster
	addrs []string
}

// NewCluster starts a kfake cluster of NumBrokers brokers on loopback ports with topics
// created, and closes it when t ends. Other topics are created on first use with
// DefaultPartitions partitions. It fails t if the cluster cannot start.
func NewCluster(t testing.TB, topics ...Topic) *Cluster {
	t.Helper()
	opts, err := kafkafake.ClusterOpts(topics)
	if err != nil {
		t.Fatal(err)
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		t.Fatalf("kafkatest: start kfake: %v", err)
	}
	t.Cleanup(c.Close)
	return &Cluster{Cluster: c, addrs: c.ListenAddrs()}
}

// Addrs returns the brokers' "host:port" addresses, for Config.Brokers.
func (c *Cluster) Addrs() []string { return slices.Clone(c.addrs) }

// CommittedOffsets returns the consumer group's committed offset (the next offset it will
// read) per partition of topic; a partition without a committed offset is absent. It fails t
// on error.
func CommittedOffsets(t testing.TB, addrs []string, group, topic string) map[int32]int64 {
	t.Helper()
	out, err := TryCommittedOffsets(addrs, group, topic)
	if err != nil {
		t.Fatalf("kafkatest: %v", err)
	}
	return out
}

// EndOffsets returns the next offset to be written (the high watermark) per partition of
// topic, i.e. how many records each partition holds. It fails t on error.
func EndOffsets(t testing.TB, addrs []string, topic string) map[int32]int64 {
	t.Helper()
	client, err := sarama.NewClient(addrs, kafkafake.SaramaConfig())
	if err != nil {
		t.Fatalf("kafkatest: client: %v", err)
	}
	defer func() { _ = client.Close() }()
	parts, err := client.Partitions(topic)
	if err != nil {
		t.Fatalf("kafkatest: partitions of %s: %v", topic, err)
	}
	out := map[int32]int64{}
	for _, p := range parts {
		off, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		if err != nil {
			t.Fatalf("kafkatest: end offset of %s/%d: %v", topic, p, err)
		}
		out[p] = off
	}
	return out
}
