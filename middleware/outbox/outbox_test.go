package outbox_test

import (
	"context"
	"database/sql"
	"encoding/base64"
	"errors"
	"fmt"
	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// failAfterStore stores through the real Outbox, then fails the first Store of the message
// whose ID is failFor, after checking that its rows are visible inside the inbox transaction:
// the failure comes after the INSERT, so the rollback must take the rows away.
type failAfterStore struct {
	inbox.Outbox
	table    string
	failFor  string
	failed   atomic.Bool
	seenInTx atomic.Int64
}

func (f *failAfterStore) Store(ctx context.Context, topic string, msgs []*message.Message) error {
	if err := f.Outbox.Store(ctx, topic, msgs); err != nil {
		return err
	}
	if len(msgs) > 0 && msgs[0].Metadata.Get("source_message") == f.failFor && f.failed.CompareAndSwap(false, true) {
		tx, _ := pgstore.TxFromContext(ctx)
		var n int64
		if err := tx.QueryRow(ctx, "SELECT count(*) FROM "+f.table).Scan(&n); err != nil {
			return err
		}
		f.seenInTx.Store(n)
		return errors.New("injected failure after the outbox insert")
	}
	return nil
}

// TestHandlerOutputGoesThroughTheOutboxOnce runs a router handler added with AddHandler on
// GoChannel that credits an account and returns two messages, with an inbox whose Outbox is
// set. A redelivered duplicate produces nothing again, a failed attempt (the handler's error
// after producing, or a failure after the outbox INSERT) leaves no rows, the router publishes
// nothing itself, and the relay forwards every stored message, in commit order, with its
// original UUID, payload and metadata.
func TestHandlerOutputGoesThroughTheOutboxOnce(t *testing.T) {
	e := newEnv(t, 6)
	ob, err := outbox.New(e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	flaky := &failAfterStore{Outbox: ob, table: e.cfg.MessagesTable(), failFor: "pay-3"}
	ib, err := inbox.New(inbox.Config{Store: e.store, ConsumerName: "billing", Outbox: flaky}, nil)
	if err != nil {
		t.Fatal(err)
	}

	in := newGoChannel()
	routerPub := &refusingPublisher{}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	runs := map[string]int{}
	var outsideAtRetry atomic.Int64
	outsideAtRetry.Store(-1)
	h := router.AddHandler("billing", "payments", in, "billing.events", routerPub, func(msg *message.Message) ([]*message.Message, error) {
		mu.Lock()
		runs[msg.UUID]++
		n := runs[msg.UUID]
		mu.Unlock()
		if msg.UUID == "pay-3" && n == 2 {
			outsideAtRetry.Store(e.outboxRows()) // on another connection: the failed attempt's rows are gone
		}
		if err := credit(msg); err != nil {
			return nil, err
		}
		if msg.UUID == "pay-2" && n == 1 {
			return produced(msg), errors.New("handler fails after producing its messages")
		}
		return produced(msg), nil
	})
	h.AddMiddleware(ib.Middleware)
	runRouter(t, router)

	pay1, pay2, pay3 := paymentMsg("pay-1", 1, 10), paymentMsg("pay-2", 2, 20), paymentMsg("pay-3", 3, 30)
	publishAcked(t, in, "payments", pay1)
	if n := e.outboxRows(); n != 2 {
		t.Fatalf("outbox rows after pay-1 = %d, want 2", n)
	}
	publishAcked(t, in, "payments", paymentMsg("pay-1", 1, 10)) // redelivered duplicate
	if n := e.outboxRows(); n != 2 {
		t.Fatalf("outbox rows after the duplicate of pay-1 = %d, want 2 (a duplicate produces nothing)", n)
	}
	publishAcked(t, in, "payments", pay2) // first attempt: error after producing; GoChannel redelivers
	if n := e.outboxRows(); n != 4 {
		t.Fatalf("outbox rows after pay-2 = %d, want 4 (the failed attempt stored nothing)", n)
	}
	publishAcked(t, in, "payments", pay3) // first attempt: failure after the INSERT
	if n := e.outboxRows(); n != 6 {
		t.Fatalf("outbox rows after pay-3 = %d, want 6 (the failed attempt's rows rolled back)", n)
	}
	if got := flaky.seenInTx.Load(); got != 6 {
		t.Fatalf("rows visible inside the failing pay-3 transaction = %d, want 6 (4 committed + 2 uncommitted)", got)
	}
	if got := outsideAtRetry.Load(); got != 4 {
		t.Fatalf("rows visible when pay-3 was retried = %d, want 4", got)
	}
	if b1, b2, b3 := e.balance(1), e.balance(2), e.balance(3); b1 != 10 || b2 != 20 || b3 != 30 {
		t.Fatalf("balances %d %d %d, want 10 20 30", b1, b2, b3)
	}
	if n := e.inboxRows(); n != 3 {
		t.Fatalf("inbox rows %d, want 3", n)
	}
	mu.Lock()
	if runs["pay-1"] != 1 || runs["pay-2"] != 2 || runs["pay-3"] != 2 {
		t.Fatalf("handler runs %v, want pay-1:1 pay-2:2 pay-3:2", runs)
	}
	mu.Unlock()
	if st := ib.Stats(); st.Processed != 3 || st.Duplicates != 1 || st.Failed != 2 {
		t.Fatalf("inbox stats %+v, want processed 3, duplicates 1, failed 2", st)
	}
	if n := routerPub.calls.Load(); n != 0 {
		t.Fatalf("the router published %d times; produced messages must only go through the outbox", n)
	}

	// Relay to a downstream Pub/Sub.
	down := newGoChannel() // blocking publish: GoChannel keeps the order only then
	events, err := down.Subscribe(context.Background(), "billing.events")
	if err != nil {
		t.Fatal(err)
	}
	// MaxInFlight 1: this test checks commit order, which pipelined publishes do not keep.
	relay, runDone := startRelay(t, outbox.RelayConfig{Config: e.cfg, Pool: e.sch.Pool, Publisher: down, PollInterval: 20 * time.Millisecond, MaxInFlight: 1})
	got := collect(t, events, 6, 10*time.Second)
	var want []*message.Message
	for _, m := range []*message.Message{pay1, pay2, pay3} {
		want = append(want, produced(m)...)
	}
	for i := range want {
		g, w := got[i], want[i]
		if g.UUID != w.UUID || string(g.Payload) != string(w.Payload) || !maps.Equal(g.Metadata, w.Metadata) {
			t.Errorf("relayed message %d = %s %s %v, want %s %s %v (in commit order)", i, g.UUID, g.Payload, g.Metadata, w.UUID, w.Payload, w.Metadata)
		}
	}
	waitAllAcked(t, e, "")
	if err := relay.Close(); err != nil {
		t.Fatalf("relay close: %v", err)
	}
	select {
	case err := <-runDone:
		if err != nil {
			t.Fatalf("relay Run returned %v after Close", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("relay Run did not return after Close")
	}
	select {
	case m := <-events:
		t.Fatalf("unexpected extra relayed message %s", m.UUID)
	default:
	}
}

// waitAllAcked waits until the relay's consumer group committed the offset of the last
// outbox row.
func waitAllAcked(t *testing.T, e *env, group string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		last := e.int(`SELECT coalesce(max("offset"), 0) FROM ` + e.cfg.MessagesTable())
		var acked int64
		_ = e.sch.Pool.QueryRow(context.Background(), "SELECT offset_acked FROM "+e.cfg.OffsetsTable()+" WHERE consumer_group = $1", group).Scan(&acked)
		if acked == last {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("relay group %q acked offset %d, last row %d", group, acked, last)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestConsumerHandlerReturningMessagesFails: a handler added with AddConsumerHandler has no
// publish topic; when messages come back through it anyway (here from a middleware between the
// inbox and the handler), the inbox refuses them with ErrNoPublishTopic (permanent) and commits
// nothing, Outbox or not.
func TestConsumerHandlerReturningMessagesFails(t *testing.T) {
	e := newEnv(t, 4)
	ob, err := outbox.New(e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{Store: e.store, ConsumerName: "billing", Outbox: ob}, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := newGoChannel()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	catcher := &errorCatcher{}
	h := router.AddConsumerHandler("billing", "payments", in, credit)
	produce := func(next message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if _, err := next(msg); err != nil {
				return nil, err
			}
			return produced(msg), nil
		}
	}
	h.AddMiddleware(catcher.middleware, ib.Middleware, produce)
	runRouter(t, router)

	publishAcked(t, in, "payments", paymentMsg("pay-1", 1, 10))
	errs := catcher.all()
	if len(errs) != 1 || !errors.Is(errs[0], inbox.ErrNoPublishTopic) || !inbox.IsPermanent(errs[0]) {
		t.Fatalf("delivery errors %v, want one ErrNoPublishTopic (permanent)", errs)
	}
	if b, ir, or := e.balance(1), e.inboxRows(), e.outboxRows(); b != 0 || ir != 0 || or != 0 {
		t.Fatalf("balance %d, inbox rows %d, outbox rows %d; want 0 0 0 (rolled back)", b, ir, or)
	}
}

// TestInboxWithoutOutboxRefusesProducedMessages: without Config.Outbox, a handler added with
// AddHandler that returns messages fails with ErrProducedMessages, nothing is committed and
// the router publishes nothing.
func TestInboxWithoutOutboxRefusesProducedMessages(t *testing.T) {
	e := newEnv(t, 4)
	ib, err := inbox.New(inbox.Config{Store: e.store, ConsumerName: "billing"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := newGoChannel()
	routerPub := &refusingPublisher{}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	catcher := &errorCatcher{}
	h := router.AddHandler("billing", "payments", in, "billing.events", routerPub, func(msg *message.Message) ([]*message.Message, error) {
		if err := credit(msg); err != nil {
			return nil, err
		}
		return produced(msg), nil
	})
	h.AddMiddleware(catcher.middleware, ib.Middleware)
	runRouter(t, router)

	publishAcked(t, in, "payments", paymentMsg("pay-1", 1, 10))
	errs := catcher.all()
	if len(errs) != 1 || !errors.Is(errs[0], inbox.ErrProducedMessages) {
		t.Fatalf("delivery errors %v, want one ErrProducedMessages", errs)
	}
	if b, ir, or := e.balance(1), e.inboxRows(), e.outboxRows(); b != 0 || ir != 0 || or != 0 {
		t.Fatalf("balance %d, inbox rows %d, outbox rows %d; want 0 0 0", b, ir, or)
	}
	if n := routerPub.calls.Load(); n != 0 {
		t.Fatalf("the router published %d times", n)
	}
}

// claimTx opens an inbox transaction through the store, as the middleware does, and returns
// its context (carrying the pgx transaction) and the transaction.
func claimTx(t *testing.T, e *env, id string) (context.Context, contract.Tx) {
	t.Helper()
	tx, res, err := e.store.Claim(t.Context(), contract.Delivery{Key: inbox.Key{MessageID: id, ConsumerName: "test"}})
	if err != nil || res.Decision != contract.Run {
		t.Fatalf("claim %s: %v %+v", id, err, res)
	}
	return tx.Context(t.Context()), tx
}

// TestStoreRefusesWhatItCannotKeep: Store needs the inbox transaction, and refuses, as
// permanent errors and before writing anything, messages whose UUID a downstream inbox would
// refuse or whose metadata the JSON envelope would alter.
func TestStoreRefusesWhatItCannotKeep(t *testing.T) {
	e := newEnv(t, 3)
	ob, err := outbox.New(e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Store(t.Context(), "events", produced(paymentMsg("x", 1, 1))); !errors.Is(err, outbox.ErrNotPgxTx) {
		t.Fatalf("Store without the inbox transaction: %v, want ErrNotPgxTx", err)
	}

	ctx, tx := claimTx(t, e, "m-1")
	defer func() { _, _ = tx.Fail(context.Background(), contract.Failure{}) }()
	badMeta := message.NewMessage("ok-id", []byte(`{}`))
	badMeta.Metadata.Set("k", "\xff")
	cases := map[string]struct {
		topic string
		msgs  []*message.Message
		key   bool
	}{
		"empty UUID":           {"events", []*message.Message{message.NewMessage("", []byte(`{}`))}, true},
		"UUID with NUL":        {"events", []*message.Message{message.NewMessage("a\x00b", []byte(`{}`))}, true},
		"UUID not UTF-8":       {"events", []*message.Message{message.NewMessage("\xfe", []byte(`{}`))}, true},
		"metadata not UTF-8":   {"events", []*message.Message{badMeta}, false},
		"nil message":          {"events", []*message.Message{nil}, false},
		"empty topic":          {"", produced(paymentMsg("x", 1, 1)), false},
		"good then bad (none)": {"events", append(produced(paymentMsg("y", 1, 1)), message.NewMessage("", nil)), true},
	}
	for name, c := range cases {
		err := ob.Store(ctx, c.topic, c.msgs)
		if err == nil || !inbox.IsPermanent(err) || errors.Is(err, inbox.ErrInvalidKey) != c.key {
			t.Errorf("%s: Store returned %v; want a permanent error (invalid key: %v)", name, err, c.key)
		}
	}
	// The refused calls wrote nothing (the transaction is still usable).
	pgtx, _ := pgstore.TxFromContext(ctx)
	var n int64
	if err := pgtx.QueryRow(ctx, "SELECT count(*) FROM "+e.cfg.MessagesTable()).Scan(&n); err != nil || n != 0 {
		t.Fatalf("rows in the transaction after refused Stores: %d, %v; want 0", n, err)
	}
	if err := ob.Store(ctx, "events", nil); err != nil {
		t.Fatalf("Store of no messages: %v", err)
	}
	// Binary payloads and long or odd UUIDs survive the envelope.
	odd := message.NewMessage(strings.Repeat("é", 100), []byte{0, 1, 2, 0xff, '"', '\\'})
	odd.Metadata.Set("nul-free unicode ✓", "valeur \u2028 \"quoted\"")
	if err := ob.Store(ctx, "events", []*message.Message{odd}); err != nil {
		t.Fatalf("Store of a binary payload: %v", err)
	}
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	down := newGoChannel()
	ch, err := down.Subscribe(context.Background(), "events")
	if err != nil {
		t.Fatal(err)
	}
	startRelay(t, outbox.RelayConfig{Config: e.cfg, Pool: e.sch.Pool, Publisher: down, PollInterval: 20 * time.Millisecond})
	got := collect(t, ch, 1, 10*time.Second)[0]
	if got.UUID != odd.UUID || string(got.Payload) != string(odd.Payload) || !maps.Equal(got.Metadata, odd.Metadata) {
		t.Fatalf("relayed %q %v %v, want %q %v %v", got.UUID, got.Payload, got.Metadata, odd.UUID, odd.Payload, odd.Metadata)
	}
}

// flakyPublisher fails the first publish of message failFor.
type flakyPublisher struct {
	message.Publisher
	failFor string
	failed  atomic.Bool
}

func (p *flakyPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if m.UUID == p.failFor && p.failed.CompareAndSwap(false, true) {
			return errors.New("broker unavailable")
		}
	}
	return p.Publisher.Publish(topic, msgs...)
}

// TestRelayRetriesAFailedPublishInOrder: with MaxInFlight 1, when the broker refuses a publish, the forwarder
// nacks and watermill-sql hands the same row again before any later one: nothing is skipped
// and the order holds.
func TestRelayRetriesAFailedPublishInOrder(t *testing.T) {
	e := newEnv(t, 4)
	ob, err := outbox.New(e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	var want []*message.Message
	for _, id := range []string{"a", "b", "c"} {
		ctx, tx := claimTx(t, e, id)
		msgs := produced(paymentMsg(id, 1, 1))
		if err := ob.Store(ctx, "events", msgs); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
		want = append(want, msgs...)
	}
	down := newGoChannel() // blocking publish: GoChannel keeps the order only then
	ch, err := down.Subscribe(context.Background(), "events")
	if err != nil {
		t.Fatal(err)
	}
	pub := &flakyPublisher{Publisher: down, failFor: want[2].UUID}
	startRelay(t, outbox.RelayConfig{Config: e.cfg, Pool: e.sch.Pool, Publisher: pub,
		PollInterval: 20 * time.Millisecond, ResendInterval: 20 * time.Millisecond, MaxInFlight: 1})
	got := collect(t, ch, len(want), 10*time.Second)
	for i := range want {
		if got[i].UUID != want[i].UUID {
			t.Fatalf("relayed order %v..., want %v...", uuids(got), uuids(want))
		}
	}
	if !pub.failed.Load() {
		t.Fatal("the injected publish failure never happened")
	}
	waitAllAcked(t, e, "")
}

func uuids(ms []*message.Message) []string {
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.UUID
	}
	return out
}

// TestRelayLifecycle: Run refuses to start without the tables, Close works before Run, Run
// after Close fails, and cancelling Run's context stops it with nil.
func TestRelayLifecycle(t *testing.T) {
	sch := testenv.NewSchema(t, 3)
	down := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	cfg := outbox.RelayConfig{Pool: sch.Pool, Publisher: down, PollInterval: 20 * time.Millisecond}

	r, err := outbox.NewRelay(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Run(t.Context()); err == nil || !strings.Contains(err.Error(), "InitializeSchema") {
		t.Fatalf("Run without the tables: %v, want an error naming InitializeSchema", err)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("Close after a refused Run: %v", err)
	}

	if err := outbox.InitializeSchema(t.Context(), sch.Pool, cfg.Config); err != nil {
		t.Fatal(err)
	}
	r, err = outbox.NewRelay(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("Close before Run: %v", err)
	}
	if err := r.Run(t.Context()); !errors.Is(err, outbox.ErrRelayClosed) {
		t.Fatalf("Run after Close: %v, want ErrRelayClosed", err)
	}

	r, err = outbox.NewRelay(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("Run: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("relay did not start")
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run after its context was cancelled: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context was cancelled")
	}
	if err := r.Close(); err != nil {
		t.Fatalf("Close after Run returned: %v", err)
	}
}

// TestInitializeSchemaConcurrently calls InitializeSchema from eight pools at once (as eight
// processes starting together would) on a schema named explicitly: all succeed. SchemaSQL
// gives the same statements as one script.
func TestInitializeSchemaConcurrently(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	cfg := outbox.Config{Topic: "billing_outbox", Schema: sch.Name}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		pool := testenv.NewPool(t, testenv.DatabaseURL(), 1) // default search_path: the Schema field decides
		wg.Go(func() { errs <- outbox.InitializeSchema(t.Context(), pool, cfg) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("concurrent InitializeSchema: %v", err)
		}
	}
	var n int
	if err := sch.Pool.QueryRow(t.Context(), "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename IN ('watermill_billing_outbox', 'watermill_offsets_billing_outbox')", sch.Name).Scan(&n); err != nil || n != 2 {
		t.Fatalf("outbox tables in %s: %d, %v; want 2", sch.Name, n, err)
	}

	script, err := outbox.SchemaSQL(outbox.Config{Topic: "other_outbox", Schema: sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sch.Pool.Exec(t.Context(), "BEGIN;\n"+script+"COMMIT;"); err != nil {
		t.Fatalf("run SchemaSQL script: %v\n%s", err, script)
	}
	if _, err := sch.Pool.Exec(t.Context(), `SELECT FROM "`+sch.Name+`".watermill_other_outbox, "`+sch.Name+`".watermill_offsets_other_outbox`); err != nil {
		t.Fatalf("tables from SchemaSQL: %v", err)
	}
}

// TestConfigValidation: invalid names and missing dependencies wrap inbox.ErrInvalidConfig.
func TestConfigValidation(t *testing.T) {
	for _, c := range []outbox.Config{
		{Topic: "bad-topic"}, {Topic: "1abc"}, {Topic: strings.Repeat("t", outbox.MaxTopicBytes+1)},
		{Topic: `x"; DROP TABLE y; --`}, {Schema: "bad schema"},
	} {
		if _, err := outbox.New(c, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("New(%+v): %v, want ErrInvalidConfig", c, err)
		}
	}
	if _, err := outbox.New(outbox.Config{Topic: strings.Repeat("t", outbox.MaxTopicBytes)}, nil); err != nil {
		t.Errorf("longest topic refused: %v", err)
	}
	ob, err := outbox.New(outbox.Config{}, nil)
	if err != nil || ob.Config().Topic != outbox.DefaultTopic {
		t.Fatalf("default config: %v, %+v", err, ob.Config())
	}
	if got := (outbox.Config{}).MessagesTable(); got != `"watermill_inbox_outbox"` {
		t.Errorf("default messages table %s", got)
	}
	if got := (outbox.Config{Schema: "s"}).OffsetsTable(); got != `"s"."watermill_offsets_inbox_outbox"` {
		t.Errorf("qualified offsets table %s", got)
	}
	if got := (outbox.Config{Schema: "s"}).MySQLMessagesTable(); got != "`s`.`watermill_inbox_outbox`" {
		t.Errorf("qualified MySQL messages table %s", got)
	}

	sch := testenv.NewSchema(t, 1)
	pub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	for name, c := range map[string]outbox.RelayConfig{
		"no pool":        {Publisher: pub},
		"pool and MySQL": {Pool: sch.Pool, MySQL: &sql.DB{}, Publisher: pub},
		"MySQL group":    {MySQL: &sql.DB{}, Publisher: pub, ConsumerGroup: "g"},
		"no publisher":   {Pool: sch.Pool},
		"bad topic":      {Pool: sch.Pool, Publisher: pub, Config: outbox.Config{Topic: "a.b"}},
		"negative batch": {Pool: sch.Pool, Publisher: pub, BatchSize: -1},
		"negative poll":  {Pool: sch.Pool, Publisher: pub, PollInterval: -time.Second},
		"group with NUL": {Pool: sch.Pool, Publisher: pub, ConsumerGroup: "a\x00"},
		"long group":     {Pool: sch.Pool, Publisher: pub, ConsumerGroup: strings.Repeat("g", 256)},
	} {
		if _, err := outbox.NewRelay(c, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("NewRelay %s: %v, want ErrInvalidConfig", name, err)
		}
	}
	if err := outbox.InitializeSchema(t.Context(), nil, outbox.Config{}); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("InitializeSchema(nil pool): %v", err)
	}
	if err := outbox.InitializeMySQLSchema(t.Context(), nil, outbox.Config{}); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("InitializeMySQLSchema(nil db): %v", err)
	}
}

// debugCounter counts log lines by message and keeps errors, for assertions on the relay's
// logging.
type debugCounter struct {
	mu     sync.Mutex
	lines  map[string]int
	errors []string
}

func (c *debugCounter) add(msg string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lines[msg]++
}
func (c *debugCounter) Error(msg string, err error, _ watermill.LogFields) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.errors = append(c.errors, msg+": "+err.Error())
}
func (c *debugCounter) Info(msg string, _ watermill.LogFields)           { c.add(msg) }
func (c *debugCounter) Debug(msg string, _ watermill.LogFields)          { c.add(msg) }
func (c *debugCounter) Trace(string, watermill.LogFields)                {}
func (c *debugCounter) With(watermill.LogFields) watermill.LoggerAdapter { return c }

// TestRelaysOfOneGroupTakeTurns runs two relays of the same consumer group, one row per
// transaction: they serialise on the group's offset row, so every message is forwarded once
// and in order, whichever relay forwards it.
func TestRelaysOfOneGroupTakeTurns(t *testing.T) {
	e := newEnv(t, 6)
	ob, err := outbox.New(e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	var want []*message.Message
	for i := range 20 {
		id := "m-" + strings.Repeat("x", i)
		ctx, tx := claimTx(t, e, id)
		msgs := produced(paymentMsg(id, 1, 1))
		if err := ob.Store(ctx, "events", msgs); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(context.Background()); err != nil {
			t.Fatal(err)
		}
		want = append(want, msgs...)
	}
	down := newGoChannel()
	ch, err := down.Subscribe(context.Background(), "events")
	if err != nil {
		t.Fatal(err)
	}
	logs := &debugCounter{lines: map[string]int{}}
	var perRelay [2]atomic.Int64
	for i := range 2 {
		count := func(h message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				out, err := h(msg)
				if err == nil {
					perRelay[i].Add(1)
				}
				return out, err
			}
		}
		r, err := outbox.NewRelay(outbox.RelayConfig{Config: e.cfg, Pool: e.sch.Pool, Publisher: down, BatchSize: 1, MaxInFlight: 1,
			PollInterval: 5 * time.Millisecond, Middlewares: []message.HandlerMiddleware{count}}, logs)
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = r.Run(context.Background()) }()
		t.Cleanup(func() { _ = r.Close() })
	}
	got := collect(t, ch, len(want), 20*time.Second)
	if !slices.Equal(uuids(got), uuids(want)) {
		t.Fatalf("relayed %v\nwant %v", uuids(got), uuids(want))
	}
	waitAllAcked(t, e, "")
	select {
	case m := <-ch:
		t.Fatalf("message %s relayed twice", m.UUID)
	case <-time.After(100 * time.Millisecond):
	}
	logs.mu.Lock()
	defer logs.mu.Unlock()
	if len(logs.errors) > 0 {
		t.Errorf("relays logged errors: %q", logs.errors)
	}
	t.Logf("forwarded per relay: %d and %d; hand-overs (40001) logged: %d", perRelay[0].Load(), perRelay[1].Load(),
		logs.lines["Outbox poll lost the consumer group's offset row to another relay; polling again"])
}

// fieldsLogger keeps every log line with its fields, as text.
type fieldsLogger struct {
	mu    sync.Mutex
	lines []string
}

func (l *fieldsLogger) add(level, msg string, err error, f watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf("%s %s err=%v %v", level, msg, err, f))
}
func (l *fieldsLogger) Error(msg string, err error, f watermill.LogFields) {
	l.add("ERROR", msg, err, f)
}
func (l *fieldsLogger) Info(msg string, f watermill.LogFields)  { l.add("INFO", msg, nil, f) }
func (l *fieldsLogger) Debug(msg string, f watermill.LogFields) { l.add("DEBUG", msg, nil, f) }
func (l *fieldsLogger) Trace(msg string, f watermill.LogFields) { l.add("TRACE", msg, nil, f) }
func (l *fieldsLogger) With(f watermill.LogFields) watermill.LoggerAdapter {
	l.add("WITH", "", nil, f)
	return l
}

// TestRelaySkipsForeignRowsWithoutLoggingThem: a row that is not a forwarder envelope (here
// written by hand) is acknowledged with AckWhenCannotUnwrap and the relay goes on; the
// forwarder logs the row's payload and metadata when it cannot unwrap it, and watermill-sql
// logs SQL arguments at trace level, but neither reaches the logger. An envelope whose
// metadata is JSON null is relayed with an empty, usable metadata map.
func TestRelaySkipsForeignRowsWithoutLoggingThem(t *testing.T) {
	e := newEnv(t, 4)
	table := e.cfg.MessagesTable()
	e.mustExec(`INSERT INTO ` + table + ` (uuid, payload, metadata, transaction_id) VALUES ('foreign', '{"secret":"s3cr3t-payload"}', '{"k":"s3cr3t-metadata"}', pg_current_xact_id())`)
	e.mustExec(`INSERT INTO ` + table + ` (uuid, payload, metadata, transaction_id) VALUES ('null-md',
		'{"destination_topic":"events","uuid":"no-metadata","payload":"e30=","metadata":null}', '{}', pg_current_xact_id())`)
	ob, err := outbox.New(e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, tx := claimTx(t, e, "m-1")
	msgs := produced(paymentMsg("m-1", 1, 1))
	msgs[0].Payload = []byte(`{"card":"s3cr3t-card"}`)
	if err := ob.Store(ctx, "events", msgs); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}

	down := newGoChannel()
	ch, err := down.Subscribe(context.Background(), "events")
	if err != nil {
		t.Fatal(err)
	}
	logs := &fieldsLogger{}
	r, err := outbox.NewRelay(outbox.RelayConfig{Config: e.cfg, Pool: e.sch.Pool, Publisher: down,
		PollInterval: 20 * time.Millisecond, AckWhenCannotUnwrap: true, MaxInFlight: 1}, logs)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = r.Run(context.Background()) }()
	t.Cleanup(func() { _ = r.Close() })

	got := collect(t, ch, 3, 10*time.Second)
	if got[0].UUID != "no-metadata" || got[0].Metadata == nil || len(got[0].Metadata) != 0 {
		t.Fatalf("first relayed %q with metadata %#v, want no-metadata with an empty map", got[0].UUID, got[0].Metadata)
	}
	got[0].Metadata.Set("usable", "yes") // a nil map would panic
	if got[1].UUID != msgs[0].UUID || got[2].UUID != msgs[1].UUID || string(got[1].Payload) != string(msgs[0].Payload) {
		t.Fatalf("relayed %v, want no-metadata then %v", uuids(got), uuids(msgs))
	}
	waitAllAcked(t, e, "")
	_ = r.Close()

	logs.mu.Lock()
	defer logs.mu.Unlock()
	unwrapLogged := false
	for _, l := range logs.lines {
		if strings.Contains(l, "s3cr3t") || strings.Contains(l, base64.StdEncoding.EncodeToString(msgs[0].Payload)) {
			t.Errorf("log line carries message contents: %s", l)
		}
		if strings.Contains(l, "cannot read") && strings.Contains(l, "row_offset:1 ") {
			unwrapLogged = true
		}
	}
	if !unwrapLogged {
		t.Errorf("the foreign row's unwrap failure was not logged; lines: %q", logs.lines)
	}
}
