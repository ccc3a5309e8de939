package deferred_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
)

// TestFencing: a worker stalls inside its handler (blocked on a channel) past the lease with
// its credit written but not committed. The server ends its idle transaction, the reaper
// releases its rows, another worker completes them; when the first resumes, its done-mark and
// commit fail and its credit is gone. The second row of its batch, reaped before it started,
// is skipped by the claim token. Each credit is applied once.
func TestFencing(t *testing.T) {
	cfg := deferred.Config{Lease: time.Second, ReapInterval: 100 * time.Millisecond, Workers: 1, BatchSize: 10, Backoff: time.Millisecond}
	ib1, s := newInbox(t, cfg, 1)
	cfg.WorkerName = "second"
	ib2 := inboxOn(t, s.Pool, s.Name, cfg)
	for k := range 2 {
		// No aggregate key: both rows go into one batch.
		m := payment("fence-"+strconv.Itoa(k), 1, 100, 0)
		m.Metadata = message.Metadata{}
		if err := ib1.Receive(m); err != nil {
			t.Fatal(err)
		}
	}
	entered, release := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	var resumedErr atomic.Value
	stall := func(msg *message.Message) error {
		if err := credit(msg); err != nil {
			return err
		}
		if first.CompareAndSwap(false, true) {
			close(entered)
			<-release
			resumedErr.Store(fmt.Sprint(msg.Context().Err()))
		}
		return nil
	}
	w1 := ib1.NewConsumerWorkers(stall)
	runWorkers(t, w1)
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the first worker never ran its handler")
	}
	runWorkers(t, ib2.NewConsumerWorkers(stall))
	waitFor(t, 15*time.Second, "both rows done by the second worker", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 2
	})
	close(release)
	waitFor(t, 10*time.Second, "the first worker fenced twice", func() bool { return ib1.Counters().Fenced == 2 })
	if b := count(t, s.Pool, "SELECT balance FROM accounts WHERE id = 1"); b != 200 {
		t.Fatalf("balance %d, want 200 (each credit once)", b)
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done' AND claimed_by = 'second/0'"); n != 2 {
		t.Fatalf("%d rows done, want 2", n)
	}
	if c := ib1.Counters(); c.Done != 0 || c.Reaped == 0 && ib2.Counters().Reaped == 0 {
		t.Fatalf("first worker counters %+v (second %+v): want no done, some reaped", c, ib2.Counters())
	}
}

// orderRecorder checks, in the handler, that no two rows of one aggregate run at once and that
// each aggregate's events arrive in sequence.
type orderRecorder struct {
	mu        sync.Mutex
	inFlight  map[string]int
	last      map[string]int
	maxFlight int
	errs      []string
	handled   atomic.Int64
}

func newOrderRecorder() *orderRecorder {
	return &orderRecorder{inFlight: map[string]int{}, last: map[string]int{}}
}

func (o *orderRecorder) handler(msg *message.Message) error {
	agg := msg.Metadata.Get("aggregate_id")
	seq, _ := strconv.Atoi(msg.Metadata.Get("seq"))
	o.mu.Lock()
	o.inFlight[agg]++
	o.maxFlight = max(o.maxFlight, o.inFlight[agg])
	if o.last[agg] != seq-1 && len(o.errs) < 10 {
		o.errs = append(o.errs, fmt.Sprintf("aggregate %s: event %d after %d", agg, seq, o.last[agg]))
	}
	o.mu.Unlock()
	time.Sleep(time.Duration(rand.IntN(300)) * time.Microsecond)
	err := credit(msg)
	o.mu.Lock()
	o.inFlight[agg]--
	if err == nil {
		o.last[agg] = seq
	}
	o.mu.Unlock()
	if err == nil {
		o.handled.Add(1)
	}
	return err
}

// TestOrderingShuffled: 200 aggregates x 50 events, received in a shuffled order while 4
// workers (two instances of two) run (see receiveShuffled): each aggregate's events are
// handled strictly in producer sequence order, never two of one aggregate at once, and every
// balance is exact.
func TestOrderingShuffled(t *testing.T) {
	const aggregates, events = 200, 50
	cfg := deferred.Config{Ordering: deferred.OrderProducerSequence, SequenceField: "seq", Workers: 2, PollInterval: 50 * time.Millisecond}
	// One pool for the receivers, one per worker instance (10 connections in all).
	s := newSchemaOnly(t, 4)
	s.CreateAccounts(t, aggregates)
	ib := inboxOn(t, s.Pool, s.Name, cfg)
	rec := newOrderRecorder()
	for range 2 {
		w := inboxOn(t, testenv.NewPool(t, s.URL, 3), s.Name, cfg)
		runWorkers(t, w.NewConsumerWorkers(rec.handler))
	}

	msgs := make([]*message.Message, 0, aggregates*events)
	for a := 1; a <= aggregates; a++ {
		for e := 1; e <= events; e++ {
			msgs = append(msgs, payment(fmt.Sprintf("o-%d-%d", a, e), a, e, e))
		}
	}
	rand.Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
	start := time.Now()
	receiveShuffled(t, ib, s.Pool, msgs)
	t.Logf("received %d in %s", len(msgs), time.Since(start))
	waitFor(t, 120*time.Second, "all rows done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == aggregates*events
	})
	if h := rec.handled.Load(); h != aggregates*events {
		t.Errorf("handler ran %d times, want %d", h, aggregates*events)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.errs) > 0 || rec.maxFlight != 1 {
		t.Fatalf("order violated (max in flight per aggregate %d): %v", rec.maxFlight, rec.errs)
	}
	want := int64(events * (events + 1) / 2)
	if n := count(t, s.Pool, "SELECT count(*) FROM accounts WHERE balance <> $1", want); n != 0 {
		t.Fatalf("%d accounts without balance %d", n, want)
	}
}

// receiveChunk is the number of messages receiveShuffled stores per round, and receiveShare
// the share of each round that goes through ib.Receive.
const (
	receiveChunk = 500
	receiveShare = 10 // percent
)

// receiveShuffled stores msgs in their (shuffled) order while the workers run, in rounds of
// receiveChunk: receiveShare percent of each round through ib.Receive from 8 goroutines, the
// rest in one INSERT of the same columns Receive writes (key, aggregate key, producer
// sequence, payload and its SHA-256, metadata as JSON), in the round's order, followed by a
// NOTIFY as Receive's. Rows arrive out of sequence order across rounds as they do one by one
// (a row's predecessor is often stored rounds later), in a twentieth of the round trips:
// 10,000 receipts one by one took 33 to 42 s of this test on the loaded 2-core machine.
// INBOX_TEST_RECEIVE_ALL=1 sends every message through ib.Receive.
func receiveShuffled(t *testing.T, ib *deferred.Inbox, pool *pgxpool.Pool, msgs []*message.Message) {
	t.Helper()
	if os.Getenv("INBOX_TEST_RECEIVE_ALL") == "1" {
		receive(t, ib, msgs, 8)
		return
	}
	insert := `INSERT INTO ` + ib.Table() + ` (message_id, consumer_name, message_uuid, aggregate_key, producer_seq, topic, payload, payload_hash, metadata)
		SELECT m.id, $1, m.id, m.agg, m.seq, '', m.payload, sha256(m.payload), m.md::jsonb
		FROM unnest($2::text[], $3::text[], $4::bigint[], $5::bytea[], $6::text[]) WITH ORDINALITY AS m(id, agg, seq, payload, md, ord)
		ORDER BY m.ord
		ON CONFLICT (message_id, consumer_name) DO NOTHING`
	cfg := ib.Config()
	for start := 0; start < len(msgs); start += receiveChunk {
		chunk := msgs[start:min(start+receiveChunk, len(msgs))]
		viaReceive := len(chunk) * receiveShare / 100
		var ids, aggs, mds []string
		var seqs []int64
		var payloads [][]byte
		for _, m := range chunk[viaReceive:] {
			seq, err := strconv.ParseInt(m.Metadata.Get(cfg.SequenceField), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			md, err := json.Marshal(map[string]string(m.Metadata))
			if err != nil {
				t.Fatal(err)
			}
			ids, aggs, seqs = append(ids, m.UUID), append(aggs, cfg.AggregateKey(m)), append(seqs, seq)
			payloads, mds = append(payloads, m.Payload), append(mds, string(md))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		tag, err := pool.Exec(ctx, insert, cfg.ConsumerName, ids, aggs, seqs, payloads, mds)
		if err == nil && tag.RowsAffected() != int64(len(ids)) {
			err = fmt.Errorf("%d rows stored, want %d", tag.RowsAffected(), len(ids))
		}
		if err == nil {
			_, err = pool.Exec(ctx, "SELECT pg_notify($1, $2)", ib.Channel(), cfg.ConsumerName)
		}
		cancel()
		if err != nil {
			t.Fatalf("store messages %d..%d: %v", start+viaReceive, start+len(chunk)-1, err)
		}
		receive(t, ib, chunk[:viaReceive], 8)
	}
	if n := count(t, pool, "SELECT count(*) FROM "+ib.Table()); n != int64(len(msgs)) {
		t.Fatalf("%d rows stored, want %d", n, len(msgs))
	}
}

// receive hands msgs to ib.Receive from n goroutines.
func receive(t testing.TB, ib *deferred.Inbox, msgs []*message.Message, n int) {
	t.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	var failed atomic.Value
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				k := int(next.Add(1)) - 1
				if k >= len(msgs) {
					return
				}
				if err := ib.Receive(msgs[k]); err != nil {
					failed.Store(err.Error())
					return
				}
			}
		}()
	}
	wg.Wait()
	if f := failed.Load(); f != nil {
		t.Fatalf("receive: %v", f)
	}
}

// TestOrderingArrivalAndFailure: in arrival order, a failing row holds back its aggregate's
// later rows until it succeeds (other aggregates proceed); under HoldAggregate a dead row
// holds them until it is replayed; under ContinueAggregate they proceed.
func TestOrderingArrivalAndFailure(t *testing.T) {
	for _, policy := range []deferred.AfterDead{deferred.HoldAggregate, deferred.ContinueAggregate} {
		t.Run(fmt.Sprint(policy), func(t *testing.T) {
			cfg := deferred.Config{Workers: 3, MaxAttempts: 2, Backoff: 20 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, AfterDead: policy, PollInterval: 50 * time.Millisecond}
			ib, s := newInbox(t, cfg, 3)
			var fixed atomic.Bool
			var order sync.Mutex
			seen := map[string][]int{}
			h := func(msg *message.Message) error {
				agg, seq := msg.Metadata.Get("aggregate_id"), msg.Metadata.Get("n")
				if agg == "1" && seq == "2" && !fixed.Load() {
					return fmt.Errorf("poison until fixed")
				}
				n, _ := strconv.Atoi(seq)
				order.Lock()
				seen[agg] = append(seen[agg], n)
				order.Unlock()
				return credit(msg)
			}
			for n := 1; n <= 5; n++ {
				for a := 1; a <= 3; a++ {
					m := payment(fmt.Sprintf("a-%d-%d", a, n), a, 1, 0)
					m.Metadata.Set("n", strconv.Itoa(n))
					if err := ib.Receive(m); err != nil {
						t.Fatal(err)
					}
				}
			}
			runWorkers(t, ib.NewConsumerWorkers(h))
			waitFor(t, 15*time.Second, "aggregates 2 and 3 done and the poison dead", func() bool {
				return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done' AND aggregate_key <> '1'") == 10 &&
					count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'dead'") == 1
			})
			time.Sleep(300 * time.Millisecond)
			held := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE aggregate_key = '1' AND status = 'pending'")
			if policy == deferred.HoldAggregate && held != 3 {
				t.Fatalf("hold: %d rows of aggregate 1 pending, want 3 held behind the dead row", held)
			}
			if policy == deferred.ContinueAggregate {
				waitFor(t, 10*time.Second, "aggregate 1 continued", func() bool {
					return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE aggregate_key = '1' AND status = 'done'") == 4
				})
			}
			fixed.Store(true)
			n, err := ib.Replay(context.Background(), deferred.ReplayParams{Keys: []string{"a-1-2"}})
			if err != nil || n != 1 {
				t.Fatalf("replay: %d, %v", n, err)
			}
			waitFor(t, 10*time.Second, "everything done", func() bool {
				return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 15
			})
			order.Lock()
			defer order.Unlock()
			want := []int{1, 2, 3, 4, 5}
			if policy == deferred.ContinueAggregate {
				want = []int{1, 3, 4, 5, 2}
			}
			for a, got := range seen {
				w := want
				if a != "1" {
					w = []int{1, 2, 3, 4, 5}
				}
				if fmt.Sprint(got) != fmt.Sprint(w) {
					t.Fatalf("aggregate %s handled %v, want %v", a, got, w)
				}
			}
			if n := count(t, s.Pool, "SELECT count(*) FROM accounts WHERE balance <> 5"); n != 0 {
				t.Fatalf("%d balances wrong", n)
			}
		})
	}
}

// TestGracefulShutdownReleases: Close while a batch is being handled finishes the row in
// progress and releases the rest of the batch: no row is left in processing, the released rows
// carry no attempt, and a new set of workers handles them once.
func TestGracefulShutdownReleases(t *testing.T) {
	ib, s := newInbox(t, deferred.Config{Workers: 1, BatchSize: 50}, 1)
	for k := range 60 {
		m := payment("g-"+strconv.Itoa(k), 1, 1, 0)
		m.Metadata = message.Metadata{}
		if err := ib.Receive(m); err != nil {
			t.Fatal(err)
		}
	}
	var runs atomic.Int64
	slow := func(msg *message.Message) error {
		runs.Add(1)
		time.Sleep(20 * time.Millisecond)
		return credit(msg)
	}
	w := ib.NewConsumerWorkers(slow)
	done := make(chan error, 1)
	go func() { done <- w.Run(context.Background()) }()
	waitFor(t, 10*time.Second, "a few rows done", func() bool { return ib.Counters().Done >= 5 })
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'processing'"); n != 0 {
		t.Fatalf("%d rows left in processing after Close", n)
	}
	pending := count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'pending'")
	if pending == 0 || count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'pending' AND attempts > 0") != 0 {
		t.Fatalf("%d pending rows, some charged an attempt they never ran", pending)
	}
	runWorkers(t, ib.NewConsumerWorkers(slow))
	waitFor(t, 20*time.Second, "all 60 done", func() bool {
		return count(t, s.Pool, "SELECT count(*) FROM inbox_deferred WHERE status = 'done'") == 60
	})
	if b, r := count(t, s.Pool, "SELECT balance FROM accounts WHERE id = 1"), runs.Load(); b != 60 || r != 60 {
		t.Fatalf("balance %d, handler runs %d; want 60 and 60", b, r)
	}
}
