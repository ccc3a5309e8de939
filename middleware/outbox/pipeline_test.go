package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
)

// recordingPublisher is a broker stand-in that answers each publish after a random delay of
// up to maxDelay (a publisher confirm's round trip), records what it accepted, measures how
// many publishes were in flight at once, and refuses the first publish of failOnce.
type recordingPublisher struct {
	maxDelay time.Duration
	failOnce string

	mu          sync.Mutex
	got         []*message.Message
	inFlight    int
	maxInFlight int
	failed      bool
}

func (p *recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	p.inFlight++
	p.maxInFlight = max(p.maxInFlight, p.inFlight)
	p.mu.Unlock()
	if p.maxDelay > 0 {
		time.Sleep(rand.N(p.maxDelay))
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.inFlight--
	for _, m := range msgs {
		if m.UUID == p.failOnce && !p.failed {
			p.failed = true
			return errors.New("broker refused the publish")
		}
		if m.Context().Err() != nil {
			return fmt.Errorf("publish of %s with a context already done: %w", m.UUID, m.Context().Err())
		}
	}
	for _, m := range msgs {
		c := m.Copy()
		c.Metadata.Set("topic", topic)
		p.got = append(p.got, c)
	}
	return nil
}

func (p *recordingPublisher) Close() error { return nil }

func (p *recordingPublisher) snapshot() []*message.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*message.Message(nil), p.got...)
}

// storeRows writes n messages through Outbox.Store, perTx to an inbox transaction, with IDs
// "<prefix>-<i>" and metadata lane = i % lanes, and returns their IDs in table order.
func storeRows(t *testing.T, e *env, ob *outbox.Outbox, prefix string, n, perTx, lanes int) []string {
	t.Helper()
	var ids []string
	for start := 0; start < n; start += perTx {
		ctx, tx := claimTx(t, e, fmt.Sprintf("%s-claim-%d", prefix, start))
		var msgs []*message.Message
		for i := start; i < min(start+perTx, n); i++ {
			m := message.NewMessage(fmt.Sprintf("%s-%d", prefix, i), []byte(fmt.Sprintf(`{"i":%d}`, i)))
			m.Metadata.Set("lane", fmt.Sprint(i%lanes))
			msgs = append(msgs, m)
			ids = append(ids, m.UUID)
		}
		if err := ob.Store(ctx, "events", msgs); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	return ids
}

// waitRelayed waits until pub accepted at least n messages.
func waitRelayed(t *testing.T, pub *recordingPublisher, n int, timeout time.Duration) []*message.Message {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		got := pub.snapshot()
		if len(got) >= n {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("relayed %d of %d messages within %s", len(got), n, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRelayPipelinesPublishesWithinABatch: with MaxInFlight 8 and a broker that takes up to
// 4 ms per confirm, the relay keeps several publishes in flight (never more than 8), delivers
// every row exactly once when nothing fails, with its UUID, payload and metadata, commits the
// group's offset to the last row, and counts them in Stats; Lag is zero afterwards and was
// the whole table before.
func TestRelayPipelinesPublishesWithinABatch(t *testing.T) {
	e := newEnv(t, 4)
	ob, err := outbox.New(e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	const n = 400
	ids := storeRows(t, e, ob, "p", n, 50, 1)
	pub := &recordingPublisher{maxDelay: 4 * time.Millisecond}
	var batches sync.Map
	cfg := outbox.RelayConfig{Config: e.cfg, Pool: e.sch.Pool, Publisher: pub, MaxInFlight: 8,
		PollInterval: 20 * time.Millisecond,
		OnBatch:      func(b outbox.RelayBatch) { batches.Store(b, true) }}
	probe, err := outbox.NewRelay(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	lag, err := probe.Lag(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if lag.Pending != n || lag.OffsetGap != n || lag.OldestAge <= 0 {
		t.Fatalf("lag before the relay ran: %+v, want %d pending, gap %d, a positive age", lag, n, n)
	}
	r, _ := startRelay(t, cfg)
	got := waitRelayed(t, pub, n, 30*time.Second)
	waitAllAcked(t, e, "")
	stopRelay(t, r) // nothing more may come, and Stats and OnBatch are final
	got = pub.snapshot()
	if len(got) != n {
		t.Fatalf("relayed %d messages, want exactly %d (no failure, so no republish)", len(got), n)
	}
	seen := map[string]bool{}
	for _, m := range got {
		seen[m.UUID] = true
		if m.Metadata.Get("topic") != "events" || !strings.HasPrefix(string(m.Payload), `{"i":`) || m.Metadata.Get("lane") != "0" {
			t.Fatalf("relayed %s to %q with payload %s metadata %v", m.UUID, m.Metadata.Get("topic"), m.Payload, m.Metadata)
		}
	}
	for _, id := range ids {
		if !seen[id] {
			t.Fatalf("row %s never relayed", id)
		}
	}
	pub.mu.Lock()
	maxIn := pub.maxInFlight
	pub.mu.Unlock()
	if maxIn < 2 || maxIn > 8 {
		t.Fatalf("at most %d publishes were in flight at once, want 2..8", maxIn)
	}
	st := r.Stats()
	if st.Relayed != n || st.FailedBatches != 0 || st.MalformedSkipped != 0 || st.InFlight != 0 || st.Batches < n/100 {
		t.Fatalf("stats %+v, want %d relayed in at least %d batches, nothing failed or in flight", st, n, n/100)
	}
	published := 0
	batches.Range(func(k, _ any) bool {
		b := k.(outbox.RelayBatch)
		if b.Committed {
			published += b.Published
		}
		return true
	})
	if published != n {
		t.Fatalf("OnBatch reported %d published in committed batches, want %d", published, n)
	}
	lag, err = r.Lag(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if lag != (outbox.RelayLag{}) {
		t.Fatalf("lag after the relay caught up: %+v, want zero", lag)
	}
	t.Logf("max in flight %d, stats %+v", maxIn, st)
}

// TestRelayFailedPipelinedPublishRepublishesTheBatch: when the broker refuses one publish of a
// pipelined batch, the batch's offset is not stored: every row of the batch is published
// again, the refused one included, nothing is lost, and the failure is counted.
func TestRelayFailedPipelinedPublishRepublishesTheBatch(t *testing.T) {
	e := newEnv(t, 4)
	ob, err := outbox.New(e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	const n = 120
	ids := storeRows(t, e, ob, "f", n, 40, 1)
	pub := &recordingPublisher{maxDelay: time.Millisecond, failOnce: ids[30]}
	r, _ := startRelay(t, outbox.RelayConfig{Config: e.cfg, Pool: e.sch.Pool, Publisher: pub, MaxInFlight: 4,
		BatchSize: 50, PollInterval: 20 * time.Millisecond, ResendInterval: 20 * time.Millisecond})
	waitRelayed(t, pub, n, 30*time.Second)
	waitAllAcked(t, e, "")
	stopRelay(t, r)
	got := pub.snapshot()
	count := map[string]int{}
	for _, m := range got {
		count[m.UUID]++
	}
	for _, id := range ids {
		if count[id] == 0 {
			t.Fatalf("row %s lost after a failed publish", id)
		}
	}
	if !pub.failed || count[ids[30]] != 1 {
		t.Fatalf("the refused publish: failed=%v, accepted %d times later, want once", pub.failed, count[ids[30]])
	}
	if count[ids[0]] < 2 {
		t.Fatalf("row %s of the failed batch was published %d times, want again after the rollback", ids[0], count[ids[0]])
	}
	if count[ids[n-1]] != 1 {
		t.Fatalf("row %s of a later batch was published %d times, want once", ids[n-1], count[ids[n-1]])
	}
	st := r.Stats()
	if st.FailedBatches < 1 || st.Relayed != n {
		t.Fatalf("stats %+v, want at least one failed batch and %d relayed (committed)", st, n)
	}
}

// TestRelayOrderingKeyKeepsEachLaneInOrder: with OrderingKey naming a lane per message, the
// broker receives each lane's messages in the table's order although publishes of different
// lanes run concurrently and take random times.
func TestRelayOrderingKeyKeepsEachLaneInOrder(t *testing.T) {
	e := newEnv(t, 4)
	ob, err := outbox.New(e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	const n, lanes = 240, 4
	storeRows(t, e, ob, "o", n, 30, lanes)
	pub := &recordingPublisher{maxDelay: 3 * time.Millisecond}
	startRelay(t, outbox.RelayConfig{Config: e.cfg, Pool: e.sch.Pool, Publisher: pub, MaxInFlight: 8,
		PollInterval: 20 * time.Millisecond,
		OrderingKey:  func(topic string, m *message.Message) string { return topic + "/" + m.Metadata.Get("lane") }})
	got := waitRelayed(t, pub, n, 30*time.Second)
	waitAllAcked(t, e, "")
	last := map[string]int{}
	for _, m := range got {
		var i int
		if _, err := fmt.Sscanf(m.UUID, "o-%d", &i); err != nil {
			t.Fatal(err)
		}
		lane := m.Metadata.Get("lane")
		if prev, ok := last[lane]; ok && i <= prev {
			t.Fatalf("lane %s: message %d arrived after %d", lane, i, prev)
		}
		last[lane] = i
	}
	pub.mu.Lock()
	defer pub.mu.Unlock()
	if pub.maxInFlight < 2 {
		t.Fatalf("lanes never ran concurrently (max in flight %d)", pub.maxInFlight)
	}
}

// levelCounter counts log lines per level and keeps the ERROR ones.
type levelCounter struct {
	mu     sync.Mutex
	errors []string
	infos  int
}

func (l *levelCounter) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errors = append(l.errors, fmt.Sprintf("%s: %v", msg, err))
}

var debugLogs = os.Getenv("RELAY_DEBUG") != ""

func (l *levelCounter) Info(msg string, f watermill.LogFields) {
	if debugLogs {
		fmt.Println("INFO", msg, f)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.infos++
}
func (l *levelCounter) Debug(string, watermill.LogFields)                {}
func (l *levelCounter) Trace(string, watermill.LogFields)                {}
func (l *levelCounter) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// TestRelayGracefulStopsLogNoErrorAndKeepProgress: five relays in turn are stopped (Close,
// then by cancelling Run's context) while they forward a backlog through a slow broker: no
// ERROR line is logged, each stop keeps the offset of what was already published (the
// backlog shrinks with every run), and in the end every row was delivered, few twice.
func TestRelayGracefulStopsLogNoErrorAndKeepProgress(t *testing.T) {
	e := newEnv(t, 4)
	ob, err := outbox.New(e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	const n = 600
	ids := storeRows(t, e, ob, "g", n, 100, 1)
	pub := &recordingPublisher{maxDelay: 2 * time.Millisecond}
	logs := &levelCounter{}
	ackedOffset := func() int64 {
		return e.int("SELECT offset_acked FROM "+e.cfg.OffsetsTable()+" WHERE consumer_group = $1", "")
	}
	var prev int64
	for run := range 5 {
		r, err := outbox.NewRelay(outbox.RelayConfig{Config: e.cfg, Pool: e.sch.Pool, Publisher: pub, MaxInFlight: 4,
			BatchSize: 50, PollInterval: 10 * time.Millisecond}, logs)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		<-r.Running()
		// Stop once this run published something (rows become visible only when no older
		// transaction runs in the cluster: other tests' transactions delay them).
		start := len(pub.snapshot())
		deadline := time.Now().Add(20 * time.Second)
		for len(pub.snapshot()) < start+30 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if run%2 == 0 {
			if err := r.Close(); err != nil {
				t.Fatalf("run %d: Close: %v", run, err)
			}
		} else {
			cancel()
		}
		if err := <-done; err != nil {
			t.Fatalf("run %d: Run: %v", run, err)
		}
		_ = r.Close()
		cancel()
		t.Logf("run %d: published so far %d, stats %+v", run, len(pub.snapshot()), r.Stats())
		if run < 4 {
			off := ackedOffset()
			if off <= prev {
				t.Fatalf("run %d: the acked offset stayed at %d after a graceful stop", run, off)
			}
			prev = off
		}
	}
	r, _ := startRelay(t, outbox.RelayConfig{Config: e.cfg, Pool: e.sch.Pool, Publisher: pub, PollInterval: 10 * time.Millisecond})
	_ = r
	waitAllAcked(t, e, "")
	count := map[string]int{}
	for _, m := range pub.snapshot() {
		count[m.UUID]++
	}
	dups := 0
	for _, id := range ids {
		if count[id] == 0 {
			t.Fatalf("row %s never relayed", id)
		}
		dups += count[id] - 1
	}
	logs.mu.Lock()
	defer logs.mu.Unlock()
	if len(logs.errors) > 0 {
		t.Fatalf("graceful stops logged errors: %q", logs.errors)
	}
	if dups > 5*4 {
		t.Fatalf("%d rows published twice over 5 graceful stops, want at most the publishes in flight (4) per stop", dups)
	}
	t.Logf("republished after 5 graceful stops: %d", dups)
}
