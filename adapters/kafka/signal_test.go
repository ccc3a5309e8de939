package kafka_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/watermill-inbox/watermill-inbox/adapters/kafka"
	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkatest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// signalSub subscribes a raw subscriber of group to topic (no router) and closes it when t
// ends (or earlier through the returned close function).
func signalSub(t *testing.T, brokers []string, group, topic string, cfgMod func(*kafka.Config)) (<-chan *message.Message, func()) {
	t.Helper()
	cfg := testKafkaConfig(brokers, group)
	if cfgMod != nil {
		cfgMod(&cfg)
	}
	sub, err := kafka.NewSubscriber(cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	closeSub := func() {
		once.Do(func() {
			if err := sub.Close(); err != nil {
				t.Errorf("close subscriber: %v", err)
			}
			cancel()
		})
	}
	t.Cleanup(closeSub)
	return msgs, closeSub
}

func receive(t *testing.T, msgs <-chan *message.Message, what string) *message.Message {
	t.Helper()
	select {
	case m, ok := <-msgs:
		if !ok {
			t.Fatalf("%s: subscription closed", what)
		}
		return m
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: nothing delivered in 30 s", what)
	}
	return nil
}

func publishKeyed(t *testing.T, pub message.Publisher, topic, id, key string) {
	t.Helper()
	m := message.NewMessage(id, []byte(`{}`))
	m.Metadata.Set(partitionKeyMetadata, key)
	if err := pub.Publish(topic, m); err != nil {
		t.Fatalf("publish %s: %v", id, err)
	}
}

// warmUp publishes one record per partition and receives (and acks) all of them: once a
// claim has delivered a record, the session has read that partition's high watermark, so
// records published afterwards are above it.
func warmUp(t *testing.T, pub message.Publisher, msgs <-chan *message.Message, topic string, partitions int32) {
	t.Helper()
	want := map[string]bool{}
	for p := range partitions {
		id := fmt.Sprintf("warm-%d-%s", p, watermill.NewShortUUID())
		want[id] = true
		publishKeyed(t, pub, topic, id, kafkatest.KeyForPartition(p, partitions))
	}
	for len(want) > 0 {
		m := receive(t, msgs, "warm-up")
		delete(want, m.UUID)
		m.Ack()
	}
}

// TestFirstDeliverySignal: a record published while the consumer holds its partition reads
// FirstDelivery once; its re-send after a nack, a second reading of the same message and a
// record that was already in the log when the partition was assigned read RedeliveryUnknown.
func TestFirstDeliverySignal(t *testing.T) {
	const topic = "signal_first"
	cluster := kafkatest.NewCluster(t, kafkatest.Topic{Name: topic, Partitions: 1})
	pub := newPublisher(t, cluster.Addrs())
	publishKeyed(t, pub, topic, "backlog-1", "")

	msgs, _ := signalSub(t, cluster.Addrs(), "g", topic, nil)
	m := receive(t, msgs, "backlog")
	if m.UUID != "backlog-1" {
		t.Fatalf("got %q, want backlog-1", m.UUID)
	}
	if got := kafka.Redelivery(m); got != inbox.RedeliveryUnknown {
		t.Errorf("record in the log at assignment: %v, want RedeliveryUnknown", got)
	}
	m.Ack()

	publishKeyed(t, pub, topic, "new-1", "")
	m = receive(t, msgs, "new record")
	if m.UUID != "new-1" {
		t.Fatalf("got %q, want new-1", m.UUID)
	}
	if got := kafka.Redelivery(m); got != inbox.FirstDelivery {
		t.Fatalf("record appended after assignment: %v, want FirstDelivery", got)
	}
	if got := kafka.Redelivery(m); got != inbox.RedeliveryUnknown {
		t.Errorf("second reading of the same message: %v, want RedeliveryUnknown", got)
	}
	m.Nack()
	re := receive(t, msgs, "re-send after nack")
	if re.UUID != "new-1" {
		t.Fatalf("got %q, want the re-send of new-1", re.UUID)
	}
	if off, _ := wmkafka.MessagePartitionOffsetFromCtx(re.Context()); off != 1 {
		t.Errorf("re-send at offset %d, want 1", off)
	}
	if got := kafka.Redelivery(re); got != inbox.RedeliveryUnknown {
		t.Errorf("re-send after a nack: %v, want RedeliveryUnknown", got)
	}
	re.Ack()

	// A message of another subscriber (or built by hand) is never a first delivery.
	if got := kafka.Redelivery(message.NewMessage("x", nil)); got != inbox.RedeliveryUnknown {
		t.Errorf("foreign message: %v", got)
	}
	if got := kafka.Redelivery(nil); got != inbox.RedeliveryUnknown {
		t.Errorf("nil message: %v", got)
	}
}

// TestFirstDeliverySignalOff: static membership and protocol versions before 2.2 give no
// signal.
func TestFirstDeliverySignalOff(t *testing.T) {
	const topic = "signal_off"
	cluster := kafkatest.NewCluster(t, kafkatest.Topic{Name: topic, Partitions: 1})
	pub := newPublisher(t, cluster.Addrs())
	check := func(t *testing.T, name string, msgs <-chan *message.Message) {
		warmUp(t, pub, msgs, topic, 1)
		publishKeyed(t, pub, topic, "off-"+name, "")
		m := receive(t, msgs, "new record")
		if got := kafka.Redelivery(m); m.UUID != "off-"+name || got != inbox.RedeliveryUnknown {
			t.Errorf("%s: %s read %v, want off-%s RedeliveryUnknown", name, m.UUID, got, name)
		}
		m.Ack()
	}
	t.Run("version 2.1", func(t *testing.T) {
		msgs, _ := signalSub(t, cluster.Addrs(), "g-v21", topic, func(c *kafka.Config) { c.SaramaVersion = sarama.V2_1_0_0 })
		check(t, "v21", msgs)
	})
	t.Run("static membership", func(t *testing.T) {
		sc, err := testKafkaConfig(cluster.Addrs(), "g-static").SubscriberConfig()
		if err != nil {
			t.Fatal(err)
		}
		sc.OverwriteSaramaConfig.Consumer.Group.InstanceId = "instance-1" // changed in place
		sub, err := wmkafka.NewSubscriber(sc, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		defer sub.Close()
		msgs, err := sub.Subscribe(context.Background(), topic)
		if err != nil {
			t.Fatal(err)
		}
		check(t, "static", msgs)
	})
}

// TestFirstDeliverySignalAfterConsumerStops: records a consumer fetched and did not ack (so
// no offset was committed) read RedeliveryUnknown on the consumer that takes the partition
// over; records published after the takeover read FirstDelivery there.
func TestFirstDeliverySignalAfterConsumerStops(t *testing.T) {
	const topic = "signal_stop"
	cluster := kafkatest.NewCluster(t, kafkatest.Topic{Name: topic, Partitions: 1})
	pub := newPublisher(t, cluster.Addrs())

	msgs1, close1 := signalSub(t, cluster.Addrs(), "g", topic, nil)
	warmUp(t, pub, msgs1, topic, 1)
	for i := 1; i <= 3; i++ {
		publishKeyed(t, pub, topic, fmt.Sprintf("r-%d", i), "")
	}
	m := receive(t, msgs1, "r-1 on the first consumer")
	if m.UUID != "r-1" {
		t.Fatalf("got %q, want r-1", m.UUID)
	}
	if got := kafka.Redelivery(m); got != inbox.FirstDelivery {
		t.Fatalf("r-1 on the first consumer: %v, want FirstDelivery", got)
	}
	close1() // r-1 never acked: its offset is not committed

	committed := kafkatest.CommittedOffsets(t, cluster.Addrs(), "g", topic)
	if committed[0] != 1 {
		t.Fatalf("committed offsets %v, want 1 on partition 0 (the warm-up record only)", committed)
	}

	msgs2, _ := signalSub(t, cluster.Addrs(), "g", topic, nil)
	for i := 1; i <= 3; i++ {
		m := receive(t, msgs2, "redelivery")
		if want := fmt.Sprintf("r-%d", i); m.UUID != want {
			t.Fatalf("got %q, want %q", m.UUID, want)
		}
		if got := kafka.Redelivery(m); got != inbox.RedeliveryUnknown {
			t.Errorf("%s, in the log when the second consumer was assigned the partition: %v, want RedeliveryUnknown", m.UUID, got)
		}
		m.Ack()
	}
	publishKeyed(t, pub, topic, "r-4", "")
	m = receive(t, msgs2, "r-4")
	if got := kafka.Redelivery(m); m.UUID != "r-4" || got != inbox.FirstDelivery {
		t.Errorf("%s: %v, want r-4 FirstDelivery", m.UUID, got)
	}
	m.Ack()
}

type signalDelivery struct {
	consumer string
	id       string
	seq      int
	signal   inbox.Redelivery
}

// TestFirstDeliverySignalAcrossRebalance: consumer A holds one unacked record per partition
// while B joins the group; the rebalance hands each partition to A or B, the held records are
// delivered again and read RedeliveryUnknown, and no record reads FirstDelivery twice or
// after an earlier delivery of it.
func TestFirstDeliverySignalAcrossRebalance(t *testing.T) {
	const topic = "signal_rebalance"
	const parts = 4
	cluster := kafkatest.NewCluster(t, kafkatest.Topic{Name: topic, Partitions: parts})
	pub := newPublisher(t, cluster.Addrs())

	var mu sync.Mutex
	var log []signalDelivery
	record := func(consumer string, m *message.Message) inbox.Redelivery {
		mu.Lock()
		defer mu.Unlock()
		s := kafka.Redelivery(m)
		log = append(log, signalDelivery{consumer: consumer, id: m.UUID, seq: len(log), signal: s})
		return s
	}

	msgsA, _ := signalSub(t, cluster.Addrs(), "g", topic, nil)
	warmUp(t, pub, msgsA, topic, parts)
	held := map[string]*message.Message{}
	for p := range int32(parts) {
		publishKeyed(t, pub, topic, fmt.Sprintf("held-%d", p), kafkatest.KeyForPartition(p, parts))
	}
	for len(held) < parts {
		m := receive(t, msgsA, "held record on A")
		if got := record("A", m); got != inbox.FirstDelivery {
			t.Errorf("%s on A before the rebalance: %v, want FirstDelivery", m.UUID, got)
		}
		held[m.UUID] = m
	}

	// B joins; A's session ends at its next heartbeat (REBALANCE_IN_PROGRESS). A then acks,
	// too late to mark the offsets: every held record is delivered again after the rebalance.
	msgsB, _ := signalSub(t, cluster.Addrs(), "g", topic, nil)
	time.Sleep(2 * time.Second)
	for _, m := range held {
		m.Ack()
	}

	// Collect deliveries from both until each held record came back once, then publish new
	// records (the new sessions have read their high watermarks: they delivered a record of
	// each partition... or of the partitions they own) and collect those too.
	all := mergeDeliveries(t, map[string]<-chan *message.Message{"A": msgsA, "B": msgsB}, nil)

	back := map[string]bool{}
	fresh := map[string]bool{}
	owners := map[string]bool{}
	deadline := time.After(60 * time.Second)
	for len(back) < parts || len(fresh) < parts {
		select {
		case g := <-all:
			s := record(g.consumer, g.m)
			owners[g.consumer] = true
			switch {
			case held[g.m.UUID] != nil:
				if s != inbox.RedeliveryUnknown {
					t.Errorf("%s redelivered to %s after the rebalance: %v, want RedeliveryUnknown", g.m.UUID, g.consumer, s)
				}
				back[g.m.UUID] = true
				if len(back) == parts {
					for p := range int32(parts) {
						publishKeyed(t, pub, topic, fmt.Sprintf("fresh-%d", p), kafkatest.KeyForPartition(p, parts))
					}
				}
			default:
				if len(g.m.UUID) > 6 && g.m.UUID[:6] == "fresh-" {
					if s != inbox.FirstDelivery {
						t.Errorf("%s on %s, published after the rebalance: %v, want FirstDelivery", g.m.UUID, g.consumer, s)
					}
					fresh[g.m.UUID] = true
				}
			}
			g.m.Ack()
		case <-deadline:
			t.Fatalf("after 60 s: %d of %d held records back, %d of %d fresh ones delivered", len(back), parts, len(fresh), parts)
		}
	}
	if !owners["A"] || !owners["B"] {
		t.Errorf("deliveries after the rebalance went to %v, want both consumers", owners)
	}

	mu.Lock()
	defer mu.Unlock()
	firsts := map[string]int{}
	seen := map[string]int{}
	for _, d := range log {
		if d.signal == inbox.FirstDelivery {
			firsts[d.id]++
			if seen[d.id] > 0 {
				t.Errorf("%s read FirstDelivery on %s after %d earlier deliveries", d.id, d.consumer, seen[d.id])
			}
		}
		seen[d.id]++
	}
	for id, n := range firsts {
		if n > 1 {
			t.Errorf("%s read FirstDelivery %d times", id, n)
		}
	}
}

// TestFirstDeliverySignalZombie: consumer A's heartbeats stop reaching the coordinator (kfake
// holds them, as a network partition or a paused process would), so the coordinator removes A
// and gives B every partition, while A, which has not heard of it, keeps fetching from the
// partition leaders (other brokers) and delivering. A record published then reaches both. B
// reads FirstDelivery; A must not: its lease (its own heartbeats, held too) has run out.
func TestFirstDeliverySignalZombie(t *testing.T) {
	const topic = "signal_zombie"
	const group = "gz"
	const parts = 4
	cluster := kafkatest.NewCluster(t, kafkatest.Topic{Name: topic, Partitions: parts})
	coord := cluster.CoordinatorFor(group)
	for p := range int32(parts) {
		// Leaders away from the coordinator: A's fetches must not share its held connection.
		if err := cluster.MoveTopicPartition(topic, p, (coord+1+p%2)%kafkatest.NumBrokers); err != nil {
			t.Fatalf("move partition %d: %v", p, err)
		}
	}
	pub := newPublisher(t, cluster.Addrs())

	msgsA, _ := signalSub(t, cluster.Addrs(), group, topic, nil)
	warmUp(t, pub, msgsA, topic, parts)

	var zombie atomic.Value // A's member ID, once its first heartbeat is caught
	zombie.Store("")
	wake := make(chan struct{})
	var wakeOnce sync.Once
	wakeUp := func() { wakeOnce.Do(func() { close(wake) }) }
	t.Cleanup(wakeUp)
	cluster.ControlKey(kmsg.Heartbeat.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		hb := req.(*kmsg.HeartbeatRequest)
		if hb.Group != group {
			return nil, nil, false
		}
		if zombie.Load().(string) == "" {
			zombie.Store(hb.MemberID) // only A is in the group yet
		}
		if hb.MemberID == zombie.Load().(string) {
			cluster.SleepControl(func() { <-wake })
		}
		return nil, nil, false
	})
	waitUntil(t, 10*time.Second, "A's heartbeat held", func() (bool, string) {
		return zombie.Load().(string) != "", ""
	})

	msgsB, _ := signalSub(t, cluster.Addrs(), group, topic, nil)
	// Each record's signal is read, and the record acked, as it arrives.
	all := mergeDeliveries(t, map[string]<-chan *message.Message{"A": msgsA, "B": msgsB}, func(m *message.Message) inbox.Redelivery {
		s := kafka.Redelivery(m)
		m.Ack()
		return s
	})

	// collect records deliveries of the records named prefix<partition> until done says so,
	// or fails t after limit.
	seen := map[string]map[string]inbox.Redelivery{"A": {}, "B": {}}
	collect := func(prefix string, limit time.Duration, done func() bool) {
		deadline := time.After(limit)
		for !done() {
			select {
			case g := <-all:
				if strings.HasPrefix(g.m.UUID, prefix) {
					seen[g.consumer][g.m.UUID] = g.signal
				}
			case <-deadline:
				t.Fatalf("%s: after %s, A saw %v, B saw %v", prefix, limit, seen["A"], seen["B"])
			}
		}
	}
	publishRound := func(prefix string) {
		for p := range int32(parts) {
			publishKeyed(t, pub, topic, fmt.Sprintf("%s%d", prefix, p), kafkatest.KeyForPartition(p, parts))
		}
	}
	countPrefix := func(consumer, prefix string) int {
		n := 0
		for id := range seen[consumer] {
			if strings.HasPrefix(id, prefix) {
				n++
			}
		}
		return n
	}
	// The coordinator drops A (session timeout 1 s) and gives B every partition: B delivers a
	// record of each partition published after it joined.
	time.Sleep(3 * time.Second)
	publishRound("join-")
	collect("join-", 30*time.Second, func() bool { return countPrefix("B", "join-") == parts })

	publishRound("fresh-")
	collect("fresh-", 30*time.Second, func() bool { return countPrefix("B", "fresh-") == parts })
	// A, the zombie, delivers what it fetched meanwhile (it has not heard it was dropped).
	collect("fresh-", 20*time.Second, func() bool { return countPrefix("A", "fresh-") > 0 })
	wakeUp()
	for id, s := range seen["B"] {
		if !strings.HasPrefix(id, "fresh-") {
			continue
		}
		if s != inbox.FirstDelivery {
			t.Errorf("B, the partition's owner, read %s as %v, want FirstDelivery", id, s)
		}
	}
	for id, s := range seen["A"] {
		if s != inbox.RedeliveryUnknown {
			t.Errorf("A, removed from the group, read %s as %v, want RedeliveryUnknown", id, s)
		}
	}
	t.Logf("zombie A delivered %d fresh records, B %d", countPrefix("A", "fresh-"), countPrefix("B", "fresh-"))
}

// TestInboxCountsKafkaRedeliveryFirst: the signal in the inbox, by the attempts table. A poison
// record published while consumer 1 holds the partition is a first delivery: its handler runs
// with no attempt recorded. Consumer 1 stops during that run (no ack, no commit; the run is
// abandoned and leaves no count, as a consumer that dies there would). Consumer 2 takes the
// partition and receives the record again: a possible redelivery, counted before each handler
// run from then on. The message is dead-lettered after MaxAttempts counted runs: MaxAttempts + 1
// runs in all, the worst case docs/design.md states. A redelivery misread as a first delivery
// would show a run that began with no new count.
func TestInboxCountsKafkaRedeliveryFirst(t *testing.T) {
	const topic = "signal_inbox"
	const dlTopic = "signal_inbox_dead"
	const maxAttempts = 3
	cluster := kafkatest.NewCluster(t, kafkatest.Topic{Name: topic, Partitions: 1}, kafkatest.Topic{Name: dlTopic, Partitions: 1})
	schema := testenv.NewSchema(t, 8)
	store := setupBank(t, schema, 1)
	pub := newPublisher(t, cluster.Addrs())

	newInbox := func() *inbox.Inbox {
		ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: bankConsumerName,
			DeadLetterPublisher: pub, DeadLetterTopic: dlTopic, MaxAttempts: maxAttempts,
			Redelivery: kafka.Redelivery}, newTestLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		return ib
	}
	// attemptsNow reads the message's recorded attempts from another connection (0: no row).
	attemptsNow := func(id string) int64 {
		return queryInt(t, schema.Pool, "SELECT coalesce(sum(attempts), 0) FROM "+store.AttemptsTable()+" WHERE message_id = $1", id)
	}
	var mu sync.Mutex
	var seen []int64 // attempts recorded when each handler run began
	release := make(chan struct{})
	handler := func(msg *message.Message) ([]*message.Message, error) {
		n := attemptsNow(msg.UUID)
		mu.Lock()
		seen = append(seen, n)
		first := len(seen) == 1
		mu.Unlock()
		if first {
			<-release // run 1 is still going when consumer 1 stops
		}
		return nil, fmt.Errorf("poison %s", msg.UUID)
	}

	msgs1, close1 := signalSub(t, cluster.Addrs(), "g", topic, nil)
	warmUp(t, pub, msgs1, topic, 1)
	publishKeyed(t, pub, topic, "poison-1", "")
	m1 := receive(t, msgs1, "poison-1 on consumer 1")
	run1 := make(chan error, 1)
	go func() {
		_, err := newInbox().Middleware(handler)(m1)
		run1 <- err
	}()
	waitUntil(t, 10*time.Second, "run 1 to start", func() (bool, string) {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) == 1, ""
	})
	close1()
	close(release)
	<-run1

	msgs2, _ := signalSub(t, cluster.Addrs(), "g", topic, nil)
	ib2 := newInbox()
	for run := 2; ; run++ {
		m := receive(t, msgs2, fmt.Sprintf("poison-1, run %d", run))
		if m.UUID != "poison-1" {
			t.Fatalf("run %d: got %q", run, m.UUID)
		}
		_, err := ib2.Middleware(handler)(m)
		if err == nil {
			m.Ack() // dead-lettered
			break
		}
		m.Nack()
		if run > maxAttempts+2 {
			t.Fatalf("still not dead-lettered after %d runs", run)
		}
	}

	mu.Lock()
	defer mu.Unlock()
	if want := []int64{0, 1, 2, 3}; fmt.Sprint(seen) != fmt.Sprint(want) {
		t.Errorf("attempts recorded when each run began = %v, want %v (run 1 uncounted, every later run counted first)", seen, want)
	}
	if n := queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.AttemptsTable()+" WHERE message_id = 'poison-1' AND dead_lettered_at IS NOT NULL AND attempts = $1", maxAttempts); n != 1 {
		t.Errorf("attempt rows of poison-1 dead-lettered after %d attempts: %d, want 1", maxAttempts, n)
	}
	if n := queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table()+" WHERE message_id = 'poison-1'"); n != 0 {
		t.Errorf("inbox rows of poison-1: %d, want 0 (never processed)", n)
	}
	if end := kafkatest.EndOffsets(t, cluster.Addrs(), dlTopic); end[0] != 1 {
		t.Errorf("dead-letter topic holds %d records, want 1", end[0])
	}
}

// delivered is a record one of several consumers received (mergeDeliveries).
type delivered struct {
	consumer string
	m        *message.Message
	signal   inbox.Redelivery // onReceive's result
}

// mergeDeliveries forwards what each named consumer's channel delivers to one channel, in
// arrival order, calling onReceive (when not nil) on the consumer's goroutine first. Its
// goroutines stop when t ends.
func mergeDeliveries(t *testing.T, chans map[string]<-chan *message.Message, onReceive func(*message.Message) inbox.Redelivery) <-chan delivered {
	all := make(chan delivered)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for name, ch := range chans {
		wg.Go(func() {
			for {
				select {
				case m, ok := <-ch:
					if !ok {
						return
					}
					d := delivered{consumer: name, m: m}
					if onReceive != nil {
						d.signal = onReceive(m)
					}
					select {
					case all <- d:
					case <-stop:
						return
					}
				case <-stop:
					return
				}
			}
		})
	}
	t.Cleanup(func() { close(stop); wg.Wait() })
	return all
}
