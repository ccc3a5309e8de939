package kafka_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkatest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

const topic = "payments"

// delivery is one row of the deliveries table.
type delivery struct {
	MessageID string
	Partition int32
	Offset    int64
	Consumer  string
	PID       int
}

func deliveries(t testing.TB, s *testenv.Schema) []delivery {
	t.Helper()
	rows, err := s.Pool.Query(context.Background(), "SELECT message_id, kafka_partition, kafka_offset, consumer, pid FROM deliveries ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []delivery
	for rows.Next() {
		var d delivery
		if err := rows.Scan(&d.MessageID, &d.Partition, &d.Offset, &d.Consumer, &d.PID); err != nil {
			t.Fatal(err)
		}
		out = append(out, d)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestSameOffsetOnTwoPartitionsIsTwoMessages publishes two different messages that Kafka
// stores at the same offset (0) of two partitions. A key built from the offset (or from topic
// and offset) would merge them and drop one; the inbox keys on the producer's message ID, so
// both payments are applied and both have an inbox row.
func TestSameOffsetOnTwoPartitionsIsTwoMessages(t *testing.T) {
	start := time.Now()
	cluster := kafkatest.NewCluster(t, kafkatest.Topic{Name: topic, Partitions: 2})
	schema := testenv.NewSchema(t, 6)
	store := setupBank(t, schema, 1)

	a := paymentMsg(t, watermill.NewUUID(), 1, 10, kafkatest.KeyForPartition(0, 2))
	b := paymentMsg(t, watermill.NewUUID(), 1, 100, kafkatest.KeyForPartition(1, 2))
	pub := newPublisher(t, cluster.Addrs())
	if err := pub.Publish(topic, a, b); err != nil {
		t.Fatalf("publish: %v", err)
	}
	if end := kafkatest.EndOffsets(t, cluster.Addrs(), topic); end[0] != 1 || end[1] != 1 {
		t.Fatalf("end offsets %v, want one record on each partition", end)
	}

	c := startConsumer(t, consumerConfig{Pool: schema.Pool, Schema: schema.Name, Brokers: cluster.Addrs(),
		Topic: topic, Group: "bank", Name: "c1"})
	waitUntil(t, 20*time.Second, "both messages processed", func() (bool, string) {
		n := queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table())
		return n >= 2, fmt.Sprintf("inbox rows=%d", n)
	})
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}

	// Both were delivered at offset 0, on partitions 0 and 1 (read from watermill-kafka's
	// message context), under two different producer IDs.
	got := map[string][2]int64{}
	for _, d := range deliveries(t, schema) {
		got[d.MessageID] = [2]int64{int64(d.Partition), d.Offset}
	}
	want := map[string][2]int64{a.UUID: {0, 0}, b.UUID: {1, 0}}
	if !maps.Equal(got, want) {
		t.Fatalf("deliveries (message -> [partition, offset]) = %v, want %v", got, want)
	}
	if bal := queryInt(t, schema.Pool, "SELECT balance FROM accounts WHERE id = 1"); bal != 110 {
		t.Errorf("balance = %d, want 110 (both payments)", bal)
	}
	if n := queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table()+" WHERE message_id = ANY($1)", []string{a.UUID, b.UUID}); n != 2 {
		t.Errorf("inbox rows = %d, want 2", n)
	}
	if st := c.Inbox.Stats(); st.Processed != 2 || st.Duplicates != 0 || st.Failed != 0 {
		t.Errorf("stats %+v, want 2 processed", st)
	}
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}

// rebalanceWorkload publishes n messages to a 4-partition topic: unique payments to accounts
// 1..10, every tenth of them published a second time later with the same ID (a producer retry;
// without a key it may land on another partition). It returns the expected balance per
// account and the set of unique IDs.
func rebalanceWorkload(t testing.TB, pub message.Publisher, n int) (want map[int]int64, ids []string) {
	t.Helper()
	want = map[int]int64{}
	var msgs, dups []*message.Message
	for i := 0; len(msgs)+len(dups) < n; i++ {
		account := i%10 + 1
		amount := int64(i + 1)
		m := paymentMsg(t, watermill.NewUUID(), account, amount, "")
		msgs = append(msgs, m)
		ids = append(ids, m.UUID)
		want[account] += amount
		if i%10 == 3 {
			dups = append(dups, paymentMsg(t, m.UUID, account, amount, ""))
		}
	}
	// Interleave: the copies go out well after their originals.
	all := slices.Concat(msgs[:len(msgs)/2], dups[:len(dups)/2], msgs[len(msgs)/2:], dups[len(dups)/2:])
	for i := 0; i < len(all); i += 50 {
		if err := pub.Publish(topic, all[i:min(i+50, len(all))]...); err != nil {
			t.Fatalf("publish: %v", err)
		}
	}
	return want, ids
}

// TestRebalanceWithMessagesInFlight runs consumer A on a 4-partition topic, starts consumer B
// in the same group while A is processing (a rebalance moves partitions with messages in
// flight), then stops A while it still processes: gracefully (router Close) or with SIGKILL
// (A runs in a child process). Every unique ID ends processed exactly once: one inbox row
// each, balances equal to the sums of unique payments, and the group's committed offsets
// reach the end of every partition.
func TestRebalanceWithMessagesInFlight(t *testing.T) {
	for _, mode := range []string{"close", "kill"} {
		t.Run(mode, func(t *testing.T) {
			start := time.Now()
			const total = 400
			const delay = 8 * time.Millisecond
			cluster := kafkatest.NewCluster(t, kafkatest.Topic{Name: topic, Partitions: 4})
			schema := testenv.NewSchema(t, 16)
			store := setupBank(t, schema, 10)
			want, ids := rebalanceWorkload(t, newPublisher(t, cluster.Addrs()), total)

			appliedBy := func(name string) int64 {
				return queryInt(t, schema.Pool, "SELECT count(*) FROM applied WHERE consumer = $1", name)
			}
			var stopA func()
			if mode == "close" {
				a := startConsumer(t, consumerConfig{Pool: schema.Pool, Schema: schema.Name, Brokers: cluster.Addrs(),
					Topic: topic, Group: "bank", Name: "A", HandlerDelay: delay})
				stopA = func() {
					if err := a.Close(); err != nil {
						t.Errorf("close A: %v", err)
					}
				}
			} else {
				a := startChild(t, childSpec{schema: schema, brokers: cluster.Addrs(), topic: topic, group: "bank",
					name: "A", handlerDelay: delay})
				stopA = func() { a.kill(t) }
			}
			waitUntil(t, 20*time.Second, "A to process 60 messages", func() (bool, string) {
				n := appliedBy("A")
				return n >= 60, fmt.Sprintf("A applied %d", n)
			})

			b := startConsumer(t, consumerConfig{Pool: schema.Pool, Schema: schema.Name, Brokers: cluster.Addrs(),
				Topic: topic, Group: "bank", Name: "B", HandlerDelay: delay})
			waitUntil(t, 20*time.Second, "the rebalance to give B partitions", func() (bool, string) {
				n := appliedBy("B")
				return n >= 20, fmt.Sprintf("B applied %d", n)
			})
			aBefore := appliedBy("A")
			stopA()
			aAtStop := appliedBy("A")
			if unique := int64(len(ids)); aAtStop+appliedBy("B") >= unique {
				t.Fatalf("everything was processed before A stopped (A %d, B %d): no message was in flight", aAtStop, appliedBy("B"))
			}

			unique := int64(len(ids))
			waitUntil(t, 30*time.Second, "every unique message processed", func() (bool, string) {
				n := queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table())
				return n >= unique, fmt.Sprintf("inbox rows=%d of %d", n, unique)
			})
			// Let B drain the remaining duplicates and commit, then leave the group.
			waitUntil(t, 20*time.Second, "B to commit the end of every partition", func() (bool, string) {
				end := kafkatest.EndOffsets(t, cluster.Addrs(), topic)
				committed, err := kafkatest.TryCommittedOffsets(cluster.Addrs(), "bank", topic)
				if err != nil {
					return false, err.Error()
				}
				for p, e := range end {
					if committed[p] != e { // a partition without records has no committed offset
						return false, fmt.Sprintf("end %v committed %v", end, committed)
					}
				}
				return true, ""

			})
			if err := b.Close(); err != nil {
				t.Fatal(err)
			}

			if got := queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table()); got != unique {
				t.Errorf("inbox rows = %d, want %d (one per unique ID)", got, unique)
			}
			if got := queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table()+" WHERE message_id = ANY($1)", ids); got != unique {
				t.Errorf("inbox rows for the published IDs = %d, want %d", got, unique)
			}
			if got := queryInt(t, schema.Pool, "SELECT count(DISTINCT message_id) FROM applied"); got != unique {
				t.Errorf("distinct applied = %d, want %d", got, unique)
			}
			if got := queryInt(t, schema.Pool, "SELECT count(*) FROM applied"); got != unique {
				t.Errorf("applied effects = %d, want %d (each unique message exactly once)", got, unique)
			}
			if got := balances(t, schema.Pool); !maps.Equal(got, want) {
				t.Errorf("balances = %v, want %v", got, want)
			}
			// B did work after A stopped, so partitions moved to it with messages A had not
			// finished; and every record was delivered at least once.
			if n := queryInt(t, schema.Pool, "SELECT count(*) FROM deliveries"); n < total {
				t.Errorf("deliveries = %d, want >= %d published records", n, total)
			}
			st := b.Inbox.Stats()
			t.Logf("%s: A applied %d before B's first 20 and %d in all; B processed %d, skipped %d duplicates; %d deliveries for %d records (%d unique); took %s",
				mode, aBefore, aAtStop, st.Processed, st.Duplicates,
				queryInt(t, schema.Pool, "SELECT count(*) FROM deliveries"), total, unique, time.Since(start).Round(time.Millisecond))
		})
	}
}

// TestCrashAfterCommitBeforeAck kills a child consumer with SIGKILL right after the inbox
// committed a chosen message and before the router acked it, so watermill-kafka never marked
// its offset. The restarted consumer resumes at the group's last committed offset, which is
// that message's: Kafka redelivers it, the inbox skips it as a duplicate, and every payment is
// applied once.
func TestCrashAfterCommitBeforeAck(t *testing.T) {
	start := time.Now()
	cluster := kafkatest.NewCluster(t, kafkatest.Topic{Name: topic, Partitions: 1})
	schema := testenv.NewSchema(t, 4)
	store := setupBank(t, schema, 1)
	amounts := []int64{1, 10, 100, 1000, 10000} // distinct digits: the balance shows which ran
	const crashAt = 2
	var msgs []*message.Message
	for _, a := range amounts {
		msgs = append(msgs, paymentMsg(t, watermill.NewUUID(), 1, a, ""))
	}
	if err := newPublisher(t, cluster.Addrs()).Publish(topic, msgs...); err != nil {
		t.Fatal(err)
	}
	crashID := msgs[crashAt].UUID
	spec := childSpec{schema: schema, brokers: cluster.Addrs(), topic: topic, group: "bank", everyAck: true}
	balance := func() int64 { return queryInt(t, schema.Pool, "SELECT balance FROM accounts WHERE id = 1") }
	inboxRows := func() int64 { return queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table()) }

	first := spec
	first.name = "first"
	first.env = []string{envCrashAfterCommit + "=" + crashID}
	c1 := startChild(t, first)
	if err := c1.WaitExit(t, 30*time.Second); !testenv.KilledBySIGKILL(err) {
		t.Fatalf("first child should have died of SIGKILL, got %v", err)
	}
	if line, _ := c1.Find("CRASH "); line != "CRASH after-commit "+crashID {
		t.Fatalf("first child died without reaching the crash point: %q", line)
	}
	// Committed in PostgreSQL: payments 0..crashAt. Committed in Kafka: offsets 0..crashAt-1
	// (CommitEveryAck), so the group resumes at the crashed message.
	if got := balance(); got != 111 {
		t.Fatalf("balance after the crash = %d, want 111 (payments 1, 10, 100)", got)
	}
	if got := inboxRows(); got != crashAt+1 {
		t.Fatalf("inbox rows after the crash = %d, want %d", got, crashAt+1)
	}
	if got := kafkatest.CommittedOffsets(t, cluster.Addrs(), "bank", topic); !maps.Equal(got, map[int32]int64{0: crashAt}) {
		t.Fatalf("committed offsets after the crash = %v, want {0: %d} (the crashed message's offset was never committed)", got, crashAt)
	}

	second := spec
	second.name = "second"
	c2 := startChild(t, second)
	waitUntil(t, 20*time.Second, "the restarted consumer to finish", func() (bool, string) {
		d := len(deliveries(t, schema))
		committed, err := kafkatest.TryCommittedOffsets(cluster.Addrs(), "bank", topic)
		return err == nil && committed[0] == int64(len(msgs)) && d >= len(msgs)+1,
			fmt.Sprintf("committed %v (%v) deliveries %d", committed, err, d)
	})
	st := c2.stop(t)

	if got := balance(); got != 11111 {
		t.Errorf("balance = %d, want 11111 (each payment once)", got)
	}
	if got := inboxRows(); got != int64(len(msgs)) {
		t.Errorf("inbox rows = %d, want %d", got, len(msgs))
	}
	if got := queryInt(t, schema.Pool, "SELECT count(*) FROM applied WHERE message_id = $1", crashID); got != 1 {
		t.Errorf("effects of the crashed message = %d, want 1", got)
	}
	// The crashed message was delivered twice at the same partition and offset: first to the
	// killed process, then, redelivered from the committed offset, to the restarted one.
	var ofCrashed []delivery
	for _, d := range deliveries(t, schema) {
		if d.MessageID == crashID {
			ofCrashed = append(ofCrashed, d)
		}
	}
	if len(ofCrashed) != 2 || ofCrashed[0].Consumer != "first" || ofCrashed[1].Consumer != "second" ||
		ofCrashed[0].Offset != crashAt || ofCrashed[1].Offset != crashAt || ofCrashed[0].PID == ofCrashed[1].PID {
		t.Errorf("deliveries of the crashed message = %+v, want offset %d to the first then the second process", ofCrashed, crashAt)
	}
	if n := len(deliveries(t, schema)); n != len(msgs)+1 {
		t.Errorf("deliveries = %d, want %d (one redelivery)", n, len(msgs)+1)
	}
	if st.Processed != uint64(len(msgs)-crashAt-1) || st.Duplicates != 1 || st.Failed != 0 {
		t.Errorf("restarted consumer stats = %+v, want processed=%d duplicates=1 failed=0", st, len(msgs)-crashAt-1)
	}
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}

// TestSequentialDuplicates publishes every message twice back to back on one partition, then
// a third time after all were processed (a late producer retry). One effect each.
func TestSequentialDuplicates(t *testing.T) {
	start := time.Now()
	cluster := kafkatest.NewCluster(t, kafkatest.Topic{Name: topic, Partitions: 2})
	schema := testenv.NewSchema(t, 6)
	store := setupBank(t, schema, 1)
	pub := newPublisher(t, cluster.Addrs())
	key := kafkatest.KeyForPartition(1, 2)
	var ids []string
	var batch []*message.Message
	for i := range 5 {
		id := watermill.NewUUID()
		ids = append(ids, id)
		amount := int64(1) << (4 * i)
		batch = append(batch, paymentMsg(t, id, 1, amount, key), paymentMsg(t, id, 1, amount, key))
	}
	if err := pub.Publish(topic, batch...); err != nil {
		t.Fatal(err)
	}
	c := startConsumer(t, consumerConfig{Pool: schema.Pool, Schema: schema.Name, Brokers: cluster.Addrs(),
		Topic: topic, Group: "bank", Name: "c"})
	waitDeliveries := func(n int) {
		waitUntil(t, 20*time.Second, fmt.Sprintf("%d deliveries acked", n), func() (bool, string) {
			st := c.Inbox.Stats()
			return st.Processed+st.Duplicates >= uint64(n), fmt.Sprintf("stats %+v", st)
		})
	}
	waitDeliveries(10)
	var again []*message.Message
	for i, id := range ids {
		again = append(again, paymentMsg(t, id, 1, int64(1)<<(4*i), key))
	}
	if err := pub.Publish(topic, again...); err != nil {
		t.Fatal(err)
	}
	waitDeliveries(15)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}

	if bal := queryInt(t, schema.Pool, "SELECT balance FROM accounts WHERE id = 1"); bal != 0x11111 {
		t.Errorf("balance = %#x, want 0x11111 (each payment once)", bal)
	}
	if n := queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table()); n != 5 {
		t.Errorf("inbox rows = %d, want 5", n)
	}
	if st := c.Inbox.Stats(); st.Processed != 5 || st.Duplicates != 10 || st.Failed != 0 {
		t.Errorf("stats %+v, want processed=5 duplicates=10", st)
	}
	for _, d := range deliveries(t, schema) {
		if d.Partition != 1 {
			t.Errorf("delivery %+v not on partition 1", d)
		}
	}
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}

// TestConcurrentDuplicatesOnTwoPartitions publishes each message to partition 0 and partition
// 1; the two copies are consumed at the same time by the partitions' goroutines. The handler
// of the copy that won the claim holds its transaction open until the other copy has been
// delivered (its row in deliveries, written before the inbox runs) and for 100 ms more, so the
// two deliveries really overlap: the loser's claim meets the winner's key lock (tried, by
// default: it waits in process) and, once the winner commits, finds the claim taken and is
// skipped. One effect per message.
func TestConcurrentDuplicatesOnTwoPartitions(t *testing.T) {
	start := time.Now()
	const n = 10
	cluster := kafkatest.NewCluster(t, kafkatest.Topic{Name: topic, Partitions: 2})
	schema := testenv.NewSchema(t, 8)
	store := setupBank(t, schema, 1)
	pub := newPublisher(t, cluster.Addrs())
	k0, k1 := kafkatest.KeyForPartition(0, 2), kafkatest.KeyForPartition(1, 2)
	var p0, p1 []*message.Message
	var want int64
	for i := range n {
		id := watermill.NewUUID()
		amount := int64(i + 1)
		want += amount
		p0 = append(p0, paymentMsg(t, id, 1, amount, k0))
		p1 = append(p1, paymentMsg(t, id, 1, amount, k1))
	}
	if err := pub.Publish(topic, slices.Concat(p0, p1)...); err != nil {
		t.Fatal(err)
	}

	var mu sync.Mutex
	overlapped := map[string]bool{}
	otherDelivered := func(msg *message.Message) bool {
		// Both copies delivered: the other one's claim runs while this transaction holds
		// the key.
		var n int
		err := schema.Pool.QueryRow(msg.Context(), "SELECT count(*) FROM deliveries WHERE message_id = $1", msg.UUID).Scan(&n)
		return err == nil && n >= 2
	}
	c := startConsumer(t, consumerConfig{Pool: schema.Pool, Schema: schema.Name, Brokers: cluster.Addrs(),
		Topic: topic, Group: "bank", Name: "c",
		AfterUpdate: func(msg *message.Message) error {
			deadline := time.Now().Add(5 * time.Second)
			for time.Now().Before(deadline) {
				if otherDelivered(msg) {
					time.Sleep(100 * time.Millisecond) // its claim meets this one's key lock
					mu.Lock()
					overlapped[msg.UUID] = true
					mu.Unlock()
					return nil
				}
				time.Sleep(5 * time.Millisecond)
			}
			return nil // not overlapped: counted below
		}})
	waitUntil(t, 30*time.Second, "every copy acked", func() (bool, string) {
		st := c.Inbox.Stats()
		return st.Processed+st.Duplicates >= 2*n, fmt.Sprintf("stats %+v", st)
	})
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}

	if bal := queryInt(t, schema.Pool, "SELECT balance FROM accounts WHERE id = 1"); bal != want {
		t.Errorf("balance = %d, want %d (each payment once)", bal, want)
	}
	if got := queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table()); got != n {
		t.Errorf("inbox rows = %d, want %d", got, n)
	}
	if st := c.Inbox.Stats(); st.Processed != n || st.Duplicates != n || st.Failed != 0 {
		t.Errorf("stats %+v, want processed=%d duplicates=%d", st, n, n)
	}
	parts := map[int32]int{}
	for _, d := range deliveries(t, schema) {
		parts[d.Partition]++
	}
	if parts[0] != n || parts[1] != n {
		t.Errorf("deliveries per partition %v, want %d on each", parts, n)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(overlapped) != n {
		t.Errorf("%d of %d duplicate pairs overlapped, want all", len(overlapped), n)
	}
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}
