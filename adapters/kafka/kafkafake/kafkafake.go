// Package kafkafake starts an in-process Kafka cluster: kfake (github.com/twmb/franz-go/pkg/kfake),
// a Kafka-protocol broker written in Go, with three brokers and seeded topics, for the demo
// (examples/billing) and for tests through package kafkatest. It does not import package
// testing, so a program may link it.
//
// kfake speaks the protocol sarama v1.61.1 needs for watermill-kafka v3 (produce, fetch,
// consumer groups, offset commit and fetch). sarama before v1.61 fails against it for
// protocol versions >= 2.4 (OffsetFetch v6).
package kafkafake

import (
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"
)

// NumBrokers is the number of brokers NewCluster starts.
const NumBrokers = 3

// DefaultPartitions is the partition count of a topic the cluster creates on first use: a
// producer or consumer asking for the metadata of a topic that does not exist creates it
// (Kafka's auto.create.topics.enable). Four, so four members of one consumer group can each
// own a partition.
const DefaultPartitions = 4

// MinSessionTimeout is the cluster's group.min.session.timeout.ms: lower than Kafka's 6 s, so
// tests can use short consumer-group session timeouts and see a killed consumer leave fast.
const MinSessionTimeout = 100 * time.Millisecond

// Topic is a topic to create with the cluster.
type Topic struct {
	// Name of the topic.
	Name string
	// Partitions is the number of partitions (at least 1).
	Partitions int32
}

// ClusterOpts are the kfake options of the clusters Start (and kafkatest.NewCluster) start:
// NumBrokers brokers, MinSessionTimeout, automatic topic creation with DefaultPartitions
// partitions, and topics seeded.
func ClusterOpts(topics []Topic) ([]kfake.Opt, error) {
	opts := []kfake.Opt{
		kfake.NumBrokers(NumBrokers),
		kfake.GroupMinSessionTimeout(MinSessionTimeout),
		kfake.AllowAutoTopicCreation(),
		kfake.DefaultNumPartitions(DefaultPartitions),
	}
	for _, tp := range topics {
		if tp.Name == "" || tp.Partitions < 1 {
			return nil, fmt.Errorf("kafkafake: invalid topic %+v", tp)
		}
		opts = append(opts, kfake.SeedTopics(tp.Partitions, tp.Name))
	}
	return opts, nil
}

// Start starts a cluster (e.g. for the demo, examples/billing, which passes the addresses to
// its child processes): it returns the brokers' "host:port"
// addresses and a function that stops the cluster.
func Start(topics ...Topic) (addrs []string, stop func(), err error) {
	opts, err := ClusterOpts(topics)
	if err != nil {
		return nil, nil, err
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		return nil, nil, fmt.Errorf("kafkafake: start kfake: %w", err)
	}
	return c.ListenAddrs(), c.Close, nil
}

// KeyForPartition returns a record key that sarama's default hash partitioner (FNV-1a of the
// key, modulo the partition count) sends to partition of a topic with partitions partitions.
// Keys are "key-<n>" for the smallest n that fits, so they are stable.
func KeyForPartition(partition, partitions int32) string {
	hp := sarama.NewHashPartitioner("")
	for n := 0; ; n++ {
		key := fmt.Sprintf("key-%d", n)
		p, err := hp.Partition(&sarama.ProducerMessage{Key: sarama.StringEncoder(key)}, partitions)
		if err == nil && p == partition {
			return key
		}
	}
}

// TryCommittedOffsets returns the consumer group's committed offset (the next offset it will
// read) per partition of topic; a partition without a committed offset is absent.
func TryCommittedOffsets(addrs []string, group, topic string) (map[int32]int64, error) {
	admin, err := sarama.NewClusterAdmin(addrs, SaramaConfig())
	if err != nil {
		return nil, fmt.Errorf("cluster admin: %w", err)
	}
	defer func() { _ = admin.Close() }()
	resp, err := admin.ListConsumerGroupOffsets(group, nil)
	if err != nil {
		return nil, fmt.Errorf("list offsets of group %s: %w", group, err)
	}
	if resp.Err != sarama.ErrNoError {
		return nil, fmt.Errorf("list offsets of group %s: %w", group, resp.Err)
	}
	out := map[int32]int64{}
	for p, b := range resp.Blocks[topic] {
		if b.Err != sarama.ErrNoError {
			return nil, fmt.Errorf("offset of %s/%d: %w", topic, p, b.Err)
		}
		if b.Offset >= 0 {
			out[p] = b.Offset
		}
	}
	return out, nil
}

// SaramaConfig is the sarama client configuration of the helpers.
func SaramaConfig() *sarama.Config {
	c := sarama.NewConfig()
	c.ClientID = "kafkatest"
	return c
}
