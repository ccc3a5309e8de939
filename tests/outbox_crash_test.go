package tests

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
)

// TestOutboxCrashAfterCommitThenRelayTwice follows produced messages from a crashed consumer
// to a downstream inbox over RabbitMQ:
//
//  1. A child consumer (inbox "bank" with the outbox, no relay) is SIGKILLed right after the
//     inbox committed its 3rd delivery, before the ack: the produced messages of 3 inputs sit
//     in the outbox and nothing reached RabbitMQ.
//  2. A restarted child finishes the queue; RabbitMQ redelivers the unacked input, which the
//     inbox skips as a duplicate, so it produces nothing again.
//  3. A relay child is SIGKILLed after forwarding 5 messages, before its batch's offset was
//     committed: those 5 are on the downstream queue and will be forwarded again.
//  4. In this process, a downstream inbox ("downstream") consumes the downstream queue while
//     three relays run at once: two of the crashed relay's consumer group (one of which
//     republishes the 5) and one of a second group, which forwards everything again.
//
// Every produced message must be counted downstream exactly once, with its original UUID,
// payload and metadata.
func TestOutboxCrashAfterCommitThenRelayTwice(t *testing.T) {
	start := time.Now()
	schema := testenv.NewSchema(t, 8)
	rabbit := newRabbitAdmin(t)
	store := setupBank(t, schema, 2)
	if _, err := schema.Pool.Exec(t.Context(), obDownstreamSchemaSQL); err != nil {
		t.Fatalf("create downstream table: %v", err)
	}
	obCfg := outbox.Config{} // unqualified: every process's search_path is the test schema
	if err := outbox.InitializeSchema(t.Context(), schema.Pool, obCfg); err != nil {
		t.Fatalf("outbox.InitializeSchema: %v", err)
	}
	input, downQueue := rabbit.newQueue(t), rabbit.newQueue(t)

	// Six payments alternating between account 1 (one produced message) and account 2 (two).
	const crashAfterCommits = 3
	var inputs []*message.Message
	var want []*message.Message // every produced message, in input order
	balances := map[int]int64{}
	for i := range 6 {
		account, amount := i%2+1, int64(1)<<(4*i)
		m := paymentMsg(t, watermill.NewUUID(), account, amount)
		inputs = append(inputs, m)
		want = append(want, obProducedFor(m, payment{Account: account, Amount: amount})...)
		balances[account] += amount
	}
	producedBy := func(n int) (c int64) { // messages produced by the first n inputs
		for i := range n {
			c += int64(i%2 + 1)
		}
		return c
	}
	rabbit.publish(t, input, inputs...)
	outboxRows := func() int64 { return queryInt(t, schema.Pool, "SELECT count(*) FROM "+obCfg.MessagesTable()) }
	inboxRows := func(consumer string) int64 {
		return queryInt(t, schema.Pool, "SELECT count(*) FROM "+store.Table()+" WHERE consumer_name = $1", consumer)
	}

	// 1. The producing consumer dies right after its 3rd commit.
	crashed := inputs[crashAfterCommits-1].UUID
	first := startOutboxChild(t, "consumer", schema, rabbit.url, input, downQueue,
		envOutboxCrashCommit+"="+strconv.Itoa(crashAfterCommits))
	obExpectSIGKILL(t, first, "after-commit", crashed)
	if got, want := outboxRows(), producedBy(crashAfterCommits); got != want {
		t.Fatalf("outbox rows after the crash = %d, want %d (the 3 committed deliveries' output)", got, want)
	}
	if got := inboxRows(bankConsumerName); got != crashAfterCommits {
		t.Fatalf("inbox rows after the crash = %d, want %d", got, crashAfterCommits)
	}
	if ready, _ := rabbit.queueState(t, downQueue); ready != 0 {
		t.Fatalf("downstream queue holds %d messages before any relay ran, want 0", ready)
	}
	waitUntil(t, 10*time.Second, "RabbitMQ to requeue the unacked input", func() (bool, string) {
		ready, consumers := rabbit.queueState(t, input)
		return ready == len(inputs)-crashAfterCommits+1 && consumers == 0, fmt.Sprintf("ready=%d consumers=%d", ready, consumers)
	})

	// 2. The restarted consumer finishes; the redelivered input is a duplicate.
	second := startOutboxChild(t, "consumer", schema, rabbit.url, input, downQueue)
	waitUntil(t, 20*time.Second, "the restarted consumer to drain the input queue", func() (bool, string) {
		ready, _ := rabbit.queueState(t, input)
		rows := inboxRows(bankConsumerName)
		return ready == 0 && rows >= int64(len(inputs)), fmt.Sprintf("ready=%d inbox rows=%d", ready, rows)
	})
	time.Sleep(ackGrace)
	if st := second.stop(t); st.Processed != uint64(len(inputs)-crashAfterCommits) || st.Duplicates != 1 || st.Failed != 0 {
		t.Fatalf("restarted consumer stats %+v, want processed=%d duplicates=1 failed=0", st, len(inputs)-crashAfterCommits)
	}
	if got := outboxRows(); got != int64(len(want)) {
		t.Fatalf("outbox rows = %d, want %d (the duplicate produced nothing)", got, len(want))
	}
	if n := queryInt(t, schema.Pool, "SELECT count(*) FROM handler_runs WHERE message_id = $1", crashed); n != 1 {
		t.Fatalf("handler runs of the crashed input = %d, want 1", n)
	}
	for account, b := range balances {
		if got := queryInt(t, schema.Pool, "SELECT balance FROM accounts WHERE id = $1", account); got != b {
			t.Fatalf("balance of account %d = %d, want %d", account, got, b)
		}
	}
	// The envelopes name the destination and keep the IDs, in commit order.
	var stored []string
	rows, err := schema.Pool.Query(t.Context(), `SELECT payload->>'uuid', payload->>'destination_topic' FROM `+obCfg.MessagesTable()+` ORDER BY transaction_id, "offset"`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, dest string
		if err := rows.Scan(&id, &dest); err != nil {
			t.Fatal(err)
		}
		if dest != downQueue {
			t.Fatalf("envelope destination %q, want %q", dest, downQueue)
		}
		stored = append(stored, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(stored, obUUIDs(want)) {
		t.Fatalf("outbox envelopes %v, want %v", stored, obUUIDs(want))
	}

	// 3. A relay dies after publishing 5 messages, before committing their offset.
	const relayCrashAfter = 5
	relayChild := startOutboxChild(t, "relay", schema, rabbit.url, input, downQueue,
		envOutboxCrashRelay+"="+strconv.Itoa(relayCrashAfter))
	obExpectSIGKILL(t, relayChild, "after-forward", "")
	if ready, _ := rabbit.queueState(t, downQueue); ready != relayCrashAfter {
		t.Fatalf("downstream queue holds %d messages after the relay crash, want %d", ready, relayCrashAfter)
	}
	if acked := queryInt(t, schema.Pool, "SELECT coalesce(max(offset_acked), 0) FROM "+obCfg.OffsetsTable()); acked != 0 {
		t.Fatalf("offset acked by the crashed relay = %d, want 0 (its batch never committed)", acked)
	}

	// 4. Downstream inbox + three relays at once.
	down := obStartDownstream(t, schema.Pool, schema.Name, rabbit.url, downQueue)
	pub := newAMQPBroker(t, rabbit.url, nil, watermill.NopLogger{}).Publisher
	relayLog := &countingLogger{}
	relays := []*obRunningRelay{
		obStartRelay(t, obRelayConfig(schema.Pool, pub, ""), relayLog),
		obStartRelay(t, obRelayConfig(schema.Pool, pub, ""), relayLog),
		obStartRelay(t, obRelayConfig(schema.Pool, pub, "second-relay"), relayLog),
	}
	lastOffset := queryInt(t, schema.Pool, `SELECT max("offset") FROM `+obCfg.MessagesTable())
	// The 5 from the crashed relay + 9 republished by group "" + 9 from group "second-relay".
	minDeliveries := int64(relayCrashAfter + 2*len(want))
	waitUntil(t, 20*time.Second, "the relays to finish and the downstream inbox to settle", func() (bool, string) {
		acked := queryInt(t, schema.Pool, "SELECT count(*) FROM "+obCfg.OffsetsTable()+" WHERE offset_acked = $1", lastOffset)
		ready, _ := rabbit.queueState(t, downQueue)
		st := down.Inbox.Stats()
		return acked == 2 && ready == 0 && int64(st.Processed+st.Duplicates) >= minDeliveries,
			fmt.Sprintf("groups done=%d/2 downstream ready=%d stats=%+v (want >= %d settled deliveries)", acked, ready, st, minDeliveries)
	})
	time.Sleep(ackGrace)
	for _, r := range relays {
		r.stop(t)
	}
	if err := down.Close(); err != nil {
		t.Fatalf("close downstream consumer: %v", err)
	}

	// Exactly once downstream: one row per produced message, no extras, original contents.
	st := down.Inbox.Stats()
	if st.Processed != uint64(len(want)) || st.Failed != 0 {
		t.Errorf("downstream stats %+v, want processed=%d failed=0", st, len(want))
	}
	if got := queryInt(t, schema.Pool, "SELECT count(*) FROM downstream_received"); got != int64(len(want)) {
		t.Errorf("downstream rows = %d, want %d", got, len(want))
	}
	if got := inboxRows(obDownstreamConsumerName); got != int64(len(want)) {
		t.Errorf("downstream inbox rows = %d, want %d", got, len(want))
	}
	type received struct{ source, name, seq, payload string }
	got := map[string]received{}
	rows, err = schema.Pool.Query(t.Context(), "SELECT message_id, source_message, name, seq, payload FROM downstream_received")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		var r received
		if err := rows.Scan(&id, &r.source, &r.name, &r.seq, &r.payload); err != nil {
			t.Fatal(err)
		}
		if _, dup := got[id]; dup {
			t.Errorf("message %s counted twice downstream", id)
		}
		got[id] = r
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	wantRecv := map[string]received{}
	for _, m := range want {
		wantRecv[m.UUID] = received{m.Metadata.Get("source_message"), m.Metadata.Get("name"), m.Metadata.Get("seq"), string(m.Payload)}
	}
	if !maps.Equal(got, wantRecv) {
		t.Errorf("downstream received %v\nwant %v", got, wantRecv)
	}
	for _, r := range got {
		var p map[string]any
		if err := json.Unmarshal([]byte(r.payload), &p); err != nil {
			t.Errorf("downstream payload %q is not the produced JSON: %v", r.payload, err)
		}
	}
	t.Logf("downstream: %d deliveries, %+v; relays: %s; took %s", down.Deliveries.Load(), st, relayLog.summary(), time.Since(start).Round(time.Millisecond))
}

func obUUIDs(ms []*message.Message) []string {
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.UUID
	}
	return out
}
