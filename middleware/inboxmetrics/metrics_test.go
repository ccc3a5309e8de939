package inboxmetrics_test

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/watermill-inbox/watermill-inbox/inboxtest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxmetrics"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// recorder is a dead-letter publisher that keeps what it was given: the business truth of
// how many dead letters went out.
type recorder struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (r *recorder) Publish(_ string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, msgs...)
	return nil
}
func (r *recorder) Close() error { return nil }
func (r *recorder) all() []*message.Message {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*message.Message(nil), r.msgs...)
}

// value returns the value of the counter, gauge or histogram sample count named name whose
// labels include want; it fails t when no such series exists.
func value(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	v, ok := lookup(t, reg, name, want)
	if !ok {
		t.Fatalf("no series %s%v in the scrape", name, want)
	}
	return v
}

func lookup(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, lp := range m.GetLabel() {
				labels[lp.GetName()] = lp.GetValue()
			}
			for k, v := range want {
				if labels[k] != v {
					continue metrics
				}
			}
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				return m.GetCounter().GetValue(), true
			case dto.MetricType_GAUGE:
				return m.GetGauge().GetValue(), true
			case dto.MetricType_HISTOGRAM:
				return float64(m.GetHistogram().GetSampleCount()), true
			}
		}
	}
	return 0, false
}

func series(t *testing.T, reg *prometheus.Registry) int {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	n := 0
	for _, mf := range mfs {
		n += len(mf.GetMetric())
	}
	return n
}

// TestScrapeEqualsBusinessTruth runs deliveries with duplicates, a key collision, a poison
// message, an invalid key, a transaction retry (a real SQLSTATE 40001 raised by PostgreSQL) and
// a handler failure that succeeds on redelivery, with produced messages relayed through the
// outbox, then scrapes the registry: every counter equals what the database and the
// dead-letter publisher hold, and the table gauges match direct queries.
func TestScrapeEqualsBusinessTruth(t *testing.T) {
	s := inboxtest.NewSchema(t, "t", 6)
	store := s.Store(t)
	s.CreateAccounts(t, 5)
	ctx := context.Background()
	ocfg := outbox.Config{Schema: s.Name}
	if err := outbox.InitializeSchema(ctx, s.Pool, ocfg); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(ocfg, nil)
	if err != nil {
		t.Fatal(err)
	}

	reg := prometheus.NewRegistry()
	m, err := inboxmetrics.New(reg, inboxmetrics.Options{})
	if err != nil {
		t.Fatal(err)
	}
	dead := &recorder{}
	const consumer = "billing"
	obs, err := m.NewObserver(consumer)
	if err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{
		Store: store, ConsumerName: consumer, MaxAttempts: 2,
		DeadLetterPublisher: dead, DeadLetterTopic: "payments.dead",
		Observer: obs, Outbox: m.Outbox(ob),
	}, nil)
	if err != nil {
		t.Fatal(err)
	}

	var handlerRuns sync.Map // message UUID -> *atomic.Int64
	runs := func(id string) *atomic.Int64 {
		v, _ := handlerRuns.LoadOrStore(id, new(atomic.Int64))
		return v.(*atomic.Int64)
	}
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		n := runs(msg.UUID).Add(1)
		tx, _ := pgstore.TxFromContext(msg.Context())
		switch {
		case msg.UUID == "poison":
			return nil, fmt.Errorf("poison payment")
		case msg.UUID == "flaky" && n == 1:
			return nil, fmt.Errorf("downstream not ready")
		case msg.UUID == "conflict" && n == 1:
			// A real serialization failure from the server: the inbox retries the whole
			// transaction, claim included.
			_, err := tx.Exec(msg.Context(), `DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '40001'; END $$`)
			return nil, err
		}
		amount, _ := strconv.Atoi(string(msg.Payload))
		if _, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + $1 WHERE id = 1", amount); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage("receipt-"+msg.UUID, []byte("receipt"))}, nil
	})
	deliver := func(id, payload string, n int) []error {
		return inboxtest.Deliver(h, message.NewMessage(id, []byte(payload)), n, inboxtest.DeliverOptions{PublishTopic: "receipts"})
	}

	unique := 0
	for i := range 20 {
		deliver(fmt.Sprintf("pay-%d", i), strconv.Itoa(i+1), 1)
		unique += i + 1
	}
	for i := range 5 { // duplicates
		deliver(fmt.Sprintf("pay-%d", i), strconv.Itoa(i+1), 1)
	}
	deliver("pay-7", "999", 1)     // a key collision: dead-lettered
	deliver("poison", "1", 3)      // failed, dead-lettered, skipped
	deliver("", "1", 1)            // invalid key: dead-lettered
	deliver("flaky", "100", 2)     // failed, then processed
	deliver("conflict", "1000", 1) // one transaction retry, processed
	unique += 100 + 1000

	// Relay the produced receipts through a real relay into a gochannel Pub/Sub.
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer pubsub.Close()
	received, err := pubsub.Subscribe(ctx, "receipts")
	if err != nil {
		t.Fatal(err)
	}
	tables, err := inboxmetrics.NewTableCollector(store, inboxmetrics.TableConfig{Outbox: &inboxmetrics.OutboxTables{Schema: s.Name}})
	if err != nil {
		t.Fatal(err)
	}
	reg.MustRegister(tables)
	var processedRows float64
	if err := s.Pool.QueryRow(ctx, "SELECT count(*) FROM "+store.Table()+" WHERE consumer_name = $1", consumer).Scan(&processedRows); err != nil {
		t.Fatal(err)
	}
	if got := value(t, reg, "watermill_inbox_outbox_backlog_rows", nil); got != processedRows {
		t.Errorf("outbox backlog before the relay ran: %v, want %v (one receipt per processed message)", got, processedRows)
	}
	relay, err := outbox.NewRelay(outbox.RelayConfig{Config: ocfg, Pool: s.Pool, Publisher: m.RelayPublisher(pubsub), PollInterval: 20 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(rctx) }()
	for i := range int(processedRows) {
		select {
		case msg := <-received:
			if _, ok := msg.Metadata[inboxmetrics.StoredAtKey]; ok {
				t.Errorf("relayed message %s still carries %s", msg.UUID, inboxmetrics.StoredAtKey)
			}
			msg.Ack()
		case <-time.After(20 * time.Second):
			t.Fatalf("relayed %d of %v receipts", i, processedRows)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for value(t, reg, "watermill_inbox_outbox_backlog_rows", nil) != 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	_ = relay.Close()
	<-relayDone

	// Business truth.
	var balance float64
	if err := s.Pool.QueryRow(ctx, "SELECT balance FROM accounts WHERE id = 1").Scan(&balance); err != nil {
		t.Fatal(err)
	}
	if balance != float64(unique) {
		t.Fatalf("balance %v, want %d: a duplicate or a failed attempt reached the account", balance, unique)
	}
	dls := dead.all()
	var collisionDLs, invalidDLs float64
	for _, dl := range dls {
		if dl.Metadata.Get(wmmiddleware.ReasonForPoisonedKey) == inbox.ErrKeyCollision.Error() {
			collisionDLs++
		}
		if dl.Metadata.Get(inbox.DeadLetterMessageKeyKey) == "" {
			invalidDLs++
		}
	}
	var deadRows, pendingRows float64
	if err := s.Pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE dead_lettered_at IS NOT NULL), count(*) FILTER (WHERE dead_lettered_at IS NULL) FROM "+store.AttemptsTable()).Scan(&deadRows, &pendingRows); err != nil {
		t.Fatal(err)
	}
	if deadRows != 1 || len(dls) != 3 || collisionDLs != 1 || invalidDLs != 1 || processedRows != 22 {
		t.Fatalf("scenario went wrong: %d dead letters (%v collision, %v invalid), %v dead-lettered rows, %v processed rows",
			len(dls), collisionDLs, invalidDLs, deadRows, processedRows)
	}
	conflictRuns := float64(runs("conflict").Load())
	lbl := func(outcome string) map[string]string {
		return map[string]string{"consumer": consumer, "outcome": outcome}
	}
	c := map[string]string{"consumer": consumer}
	stats := ib.Stats()
	checks := []struct {
		what      string
		got, want float64
	}{
		{"processed = rows in the inbox table", value(t, reg, "watermill_inbox_deliveries_total", lbl("processed")), processedRows},
		{"duplicates = re-sent deliveries (balance unchanged)", value(t, reg, "watermill_inbox_deliveries_total", lbl("duplicate")), 5},
		{"dead_lettered = dead letters published", value(t, reg, "watermill_inbox_deliveries_total", lbl("dead_lettered")), float64(len(dls))},
		{"dead_lettered_skip = deliveries after the poison's dead letter", value(t, reg, "watermill_inbox_deliveries_total", lbl("dead_lettered_skip")), 3 - 2},
		{"failed_retryable = handler failures before success or dead letter", value(t, reg, "watermill_inbox_deliveries_total", lbl("failed_retryable")), float64(runs("poison").Load()-1) + 1},
		{"key collisions = collision dead letters", value(t, reg, "watermill_inbox_key_collisions_total", c), collisionDLs},
		{"invalid keys = dead letters without a key", value(t, reg, "watermill_inbox_invalid_keys_total", c), invalidDLs},
		{"tx retries = extra handler runs of the conflicted message", value(t, reg, "watermill_inbox_tx_retries_total", c), conflictRuns - 1},
		{"relayed = receipts received downstream", value(t, reg, "watermill_inbox_outbox_relayed_messages_total", map[string]string{"topic": "receipts"}), processedRows},
		{"relay lag observations = receipts", value(t, reg, "watermill_inbox_outbox_relay_lag_seconds", nil), processedRows},
		{"commit observations = commits", value(t, reg, "watermill_inbox_commit_duration_seconds", c), processedRows},
		{"handler observations = deliveries that ran the handler", value(t, reg, "watermill_inbox_handler_duration_seconds", c), processedRows + 2 + 1},
		{"claim observations = deliveries with a valid key", value(t, reg, "watermill_inbox_claim_duration_seconds", c), 20 + 5 + 1 + 3 + 2 + 1},
		{"dead-lettered rows gauge", value(t, reg, "watermill_inbox_dead_lettered_rows", nil), deadRows},
		{"attempts pending gauge", value(t, reg, "watermill_inbox_attempts_pending_rows", nil), pendingRows},
		{"outbox backlog after the relay", value(t, reg, "watermill_inbox_outbox_backlog_rows", nil), 0},
		{"Stats().Processed", float64(stats.Processed), processedRows},
		{"Stats().TxRetries", float64(stats.TxRetries), conflictRuns - 1},
	}
	for _, ck := range checks {
		if ck.got != ck.want {
			t.Errorf("%s: scraped %v, want %v", ck.what, ck.got, ck.want)
		}
	}
	if conflictRuns != 2 {
		t.Errorf("the conflicted message ran its handler %v times, want 2 (one retry)", conflictRuns)
	}

	// Gauges against direct queries, after ANALYZE (reltuples is an estimate).
	s.Exec(t, "ANALYZE "+store.Table())
	var rows, heap, index, age float64
	if err := s.Pool.QueryRow(ctx, "SELECT count(*), pg_relation_size($1::regclass), pg_indexes_size($1::regclass), extract(epoch FROM now() - min(received_at)) FROM "+store.Table(),
		store.Table()).Scan(&rows, &heap, &index, &age); err != nil {
		t.Fatal(err)
	}
	if got := value(t, reg, "watermill_inbox_table_rows", nil); math.Abs(got-rows) > 0.1*rows {
		t.Errorf("table_rows %v, count(*) %v: outside the 10%% estimate tolerance", got, rows)
	}
	if got := value(t, reg, "watermill_inbox_table_heap_bytes", nil); got != heap {
		t.Errorf("table_heap_bytes %v, pg_relation_size %v", got, heap)
	}
	if got := value(t, reg, "watermill_inbox_table_index_bytes", nil); got != index {
		t.Errorf("table_index_bytes %v, pg_indexes_size %v", got, index)
	}
	if got := value(t, reg, "watermill_inbox_table_bytes_per_row", nil); math.Abs(got-(heap+index)/rows) > 0.1*(heap+index)/rows {
		t.Errorf("table_bytes_per_row %v, want about %v", got, (heap+index)/rows)
	}
	if got := value(t, reg, "watermill_inbox_table_oldest_row_age_seconds", nil); math.Abs(got-age) > 2 {
		t.Errorf("table_oldest_row_age_seconds %v, direct %v", got, age)
	}
	if got := value(t, reg, "watermill_inbox_table_stats_up", nil); got != 1 {
		t.Errorf("table_stats_up %v", got)
	}
	for _, mf := range mustGather(t, reg) {
		for _, mm := range mf.GetMetric() {
			for _, lp := range mm.GetLabel() {
				if strings.HasPrefix(lp.GetValue(), "pay-") || lp.GetValue() == "poison" {
					t.Errorf("metric %s has a message ID as label %s", mf.GetName(), lp.GetName())
				}
			}
		}
	}
}

func mustGather(t *testing.T, reg *prometheus.Registry) []*dto.MetricFamily {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	return mfs
}
