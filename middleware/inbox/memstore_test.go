package inbox_test

// The middleware's decisions on the in-memory reference store: no database, milliseconds. The
// same decisions are tested end to end on PostgreSQL in the other files.

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

type recorder struct {
	mu      sync.Mutex
	results []inbox.Result
}

func (r *recorder) ObserveDelivery(_ context.Context, res inbox.Result) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.results = append(r.results, res)
}

func (r *recorder) outcomes() []inbox.Outcome {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []inbox.Outcome
	for _, res := range r.results {
		out = append(out, res.Outcome)
	}
	return out
}

type memPublisher struct {
	mu   sync.Mutex
	msgs []*message.Message
	down bool
}

func (p *memPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.down {
		return errors.New("dead-letter broker down")
	}
	p.msgs = append(p.msgs, msgs...)
	return nil
}
func (p *memPublisher) Close() error { return nil }

// TestOutcomesOnMemStore walks one message through every outcome the dead-letter path has,
// and checks each is reported once, with the attempt count, and the business value.
func TestOutcomesOnMemStore(t *testing.T) {
	store := storetest.NewMemStore()
	rec := &recorder{}
	dl := &memPublisher{}
	failing := true
	ib, err := inbox.New(inbox.Config{
		Store: store, ConsumerName: "billing", Observer: rec,
		DeadLetterPublisher: dl, DeadLetterTopic: "dead", MaxAttempts: 2,
		Redelivery: func(m *message.Message) inbox.Redelivery {
			if m.Metadata.Get("redelivered") == "true" {
				return inbox.Redelivered
			}
			return inbox.FirstDelivery
		},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := storetest.MemTxFromContext(msg.Context())
		tx.Add("balance", 10)
		if failing {
			return nil, errors.New("ledger down")
		}
		return nil, nil
	})
	deliver := func(id string, redelivered bool) error {
		m := message.NewMessage(id, []byte("p"))
		if redelivered {
			m.Metadata.Set("redelivered", "true")
		}
		_, err := h(m)
		return err
	}
	key := inbox.Key{MessageID: "m1", ConsumerName: "billing"}
	// First delivery fails: counted after the fact, nacked.
	if err := deliver("m1", false); err == nil {
		t.Fatal("failed delivery acked")
	}
	if n := store.Records()[key].Attempts; n != 1 {
		t.Fatalf("attempts after one failure = %d, want 1", n)
	}
	// Redelivery fails: counted before, second attempt: dead-lettered, acked.
	if err := deliver("m1", true); err != nil {
		t.Fatalf("dead-lettered delivery nacked: %v", err)
	}
	// Later deliveries are skipped.
	if err := deliver("m1", true); err != nil {
		t.Fatal(err)
	}
	// Another message: processed, then a duplicate; a collision is dead-lettered.
	failing = false
	for _, d := range []struct {
		id      string
		payload string
	}{{"m2", "p"}, {"m2", "p"}} {
		m := message.NewMessage(d.id, []byte(d.payload))
		if _, err := h(m); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := h(message.NewMessage("m2", []byte("other payload"))); err != nil {
		t.Fatal(err)
	}
	want := []inbox.Outcome{inbox.OutcomeFailedRetryable, inbox.OutcomeDeadLettered, inbox.OutcomeDeadLetteredSkip,
		inbox.OutcomeProcessed, inbox.OutcomeDuplicate, inbox.OutcomeDeadLettered}
	got := rec.outcomes()
	if len(got) != len(want) {
		t.Fatalf("outcomes %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("outcomes %v, want %v", got, want)
		}
	}
	if a := rec.results[1].Attempts; a != 2 {
		t.Fatalf("dead letter reported %d attempts, want 2", a)
	}
	if v := store.Value("balance"); v != 10 {
		t.Fatalf("balance %d, want 10 (only m2's one commit)", v)
	}
	if len(dl.msgs) != 2 || !store.Records()[key].DeadLettered {
		t.Fatalf("dead letters %d, record %+v", len(dl.msgs), store.Records()[key])
	}
	if s := ib.Stats(); s.Processed != 1 || s.Duplicates != 1 || s.DeadLettered != 2 || s.DeadLetteredSkips != 1 || s.Failed != 1 || s.Collisions != 1 {
		t.Fatalf("stats %+v", s)
	}
}

// TestAbandonedDeliveryOnMemStore: a delivery whose consumer shuts down mid-handler takes its
// count back, on the reference store too.
func TestAbandonedDeliveryOnMemStore(t *testing.T) {
	store := storetest.NewMemStore()
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing", DeadLetterPublisher: &memPublisher{}, DeadLetterTopic: "dead", MaxAttempts: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		cancel() // the router closes
		return nil, msg.Context().Err()
	})
	m := message.NewMessage("m1", nil)
	m.SetContext(ctx)
	if _, err := h(m); err == nil {
		t.Fatal("abandoned delivery acked")
	}
	if r := store.Records(); len(r) != 0 {
		t.Fatalf("records after an abandoned delivery: %+v, want none", r)
	}
	if s := ib.Stats(); s.DeadLettered != 0 || s.Failed != 1 {
		t.Fatalf("stats %+v", s)
	}
}

// TestReplayDeadLetterOnMemStore: a consumer keyed by a business key dead-letters a message;
// ReplayDeadLetter clears the key named in the dead letter (not the UUID) and republishes the
// message without the dead-letter metadata to its topic; the handler, fixed, runs once. A
// second replay, and a replay by another consumer, are refused.
func TestReplayDeadLetterOnMemStore(t *testing.T) {
	store := storetest.NewMemStore()
	dl := &memPublisher{}
	ke, err := inbox.MetadataKey("order_id")
	if err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "orders", KeyExtractor: ke,
		DeadLetterPublisher: dl, DeadLetterTopic: "dead", MaxAttempts: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	broken := true
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if broken {
			return nil, errors.New("bug")
		}
		tx, _ := storetest.MemTxFromContext(msg.Context())
		tx.Add("reserved", 1)
		return nil, nil
	})
	msg := message.NewMessage("uuid-1", []byte("order"))
	msg.Metadata.Set("order_id", "order-42")
	if _, err := h(msg); err != nil {
		t.Fatalf("dead-lettered delivery: %v", err)
	}
	if len(dl.msgs) != 1 {
		t.Fatalf("dead letters %d", len(dl.msgs))
	}
	dead := dl.msgs[0]
	// A router sets the topic the message was consumed from; without one the test does.
	dead.Metadata.Set(wmmiddleware.PoisonedTopicKey, "orders")
	if replayed, err := ib.Replay(context.Background(), dead.UUID); err != nil || replayed {
		t.Fatalf("Replay by UUID = %v, %v; want false: the key is the order ID", replayed, err)
	}
	other, _ := inbox.New(inbox.Config{Store: store, ConsumerName: "shipping"}, nil)
	republished := &memPublisher{}
	if err := other.ReplayDeadLetter(context.Background(), dead, republished); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("replay by another consumer: %v, want ErrInvalidConfig", err)
	}
	broken = false
	if err := ib.ReplayDeadLetter(context.Background(), dead, republished); err != nil {
		t.Fatal(err)
	}
	if err := ib.ReplayDeadLetter(context.Background(), dead, republished); !errors.Is(err, inbox.ErrNotDeadLettered) {
		t.Fatalf("second replay: %v, want ErrNotDeadLettered", err)
	}
	if len(republished.msgs) != 1 {
		t.Fatalf("republished %d messages, want 1", len(republished.msgs))
	}
	again := republished.msgs[0]
	if again.UUID != "uuid-1" || again.Metadata.Get("order_id") != "order-42" || again.Metadata.Get(inbox.DeadLetterAttemptsKey) != "" {
		t.Fatalf("republished %s %v", again.UUID, again.Metadata)
	}
	if _, err := h(again); err != nil {
		t.Fatal(err)
	}
	if v := store.Value("reserved"); v != 1 {
		t.Fatalf("reserved %d, want 1", v)
	}
}

// TestInvalidKeyFloodIsBraked: MetadataKey("orderId") where producers write order_id: every
// key is empty. After the first few (MinInvalid - 1), the inbox nacks them with
// ErrInvalidKeyFlood instead of dead-lettering the stream; once the field is right again, a
// single bad message among good ones is dead-lettered as before.
func TestInvalidKeyFloodIsBraked(t *testing.T) {
	store := storetest.NewMemStore()
	dl := &memPublisher{}
	mistyped, err := inbox.MetadataKey("orderId")
	if err != nil {
		t.Fatal(err)
	}
	brake := inbox.InvalidKeyBrake{Window: 20, MinInvalid: 5, Pause: time.Millisecond}
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "orders", KeyExtractor: mistyped,
		DeadLetterPublisher: dl, DeadLetterTopic: "dead", InvalidKeyBrake: brake}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := ib.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	order := func(i int) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte("order"))
		m.Metadata.Set("order_id", fmt.Sprintf("order-%d", i))
		return m
	}
	var flood int
	for i := range 26 {
		_, err := h(order(i))
		switch {
		case errors.Is(err, inbox.ErrInvalidKeyFlood):
			if inbox.IsPermanent(err) {
				t.Fatal("a braked delivery must not be permanent")
			}
			flood++
		case err != nil:
			t.Fatalf("message %d: %v", i, err)
		}
	}
	if len(dl.msgs) != brake.MinInvalid-1 || flood != 26-(brake.MinInvalid-1) {
		t.Fatalf("dead letters %d, braked %d; want %d and %d", len(dl.msgs), flood, brake.MinInvalid-1, 26-(brake.MinInvalid-1))
	}
	if s := ib.Stats(); s.InvalidKeyBrakes != uint64(flood) || s.DeadLettered != uint64(len(dl.msgs)) {
		t.Fatalf("stats %+v", s)
	}

	// Fixed: the right field. 40 good messages push the bad ones out of the window; then one
	// bad message is dead-lettered, not braked.
	fixedKey, _ := inbox.MetadataKey("order_id")
	ib, err = inbox.New(inbox.Config{Store: store, ConsumerName: "orders", KeyExtractor: fixedKey,
		DeadLetterPublisher: dl, DeadLetterTopic: "dead", InvalidKeyBrake: brake}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h = ib.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	for i := range 10 {
		if _, err := h(order(i)); err != nil {
			t.Fatal(err)
		}
	}
	before := len(dl.msgs)
	if _, err := h(message.NewMessage(watermill.NewUUID(), []byte("no key"))); err != nil {
		t.Fatalf("a single bad message among good ones: %v, want dead-lettered and acked", err)
	}
	if len(dl.msgs) != before+1 {
		t.Fatal("the single bad message was not dead-lettered")
	}
	if s := ib.Stats(); s.Processed != 10 || s.InvalidKeyBrakes != 0 {
		t.Fatalf("stats %+v", s)
	}
}

// TestKeysCannotForgeLogLines: a message ID with a newline and a fake log record, through
// every path that logs it (processed, duplicate, dead-lettered, invalid key) at the most
// verbose level, adds no line to the log.
func TestKeysCannotForgeLogLines(t *testing.T) {
	var buf strings.Builder
	logger := watermill.NewStdLoggerWithOut(&buf, true, true)
	ib, err := inbox.New(inbox.Config{Store: storetest.NewMemStore(), ConsumerName: "billing",
		DeadLetterPublisher: &memPublisher{}, DeadLetterTopic: "dead", MaxAttempts: 1}, logger)
	if err != nil {
		t.Fatal(err)
	}
	fail := false
	h := ib.Middleware(func(*message.Message) ([]*message.Message, error) {
		if fail {
			return nil, errors.New("boom")
		}
		return nil, nil
	})
	forged := "pay-1\nlevel=ERROR msg=\"forged entry\"\r\x1b[2K"
	_, _ = h(message.NewMessage(forged, []byte("a")))
	_, _ = h(message.NewMessage(forged, []byte("a"))) // duplicate
	fail = true
	_, _ = h(message.NewMessage(forged+"-2", []byte("b"))) // dead-lettered
	_, _ = h(message.NewMessage("", []byte("c")))          // invalid key
	for _, line := range strings.Split(buf.String(), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "level=ERROR msg=\"forged") || strings.Contains(line, "\x1b") || strings.Contains(line, "\r") {
			t.Fatalf("a key forged or corrupted a log line: %q\n%s", line, buf.String())
		}
	}
	if !strings.Contains(buf.String(), `pay-1\nlevel=ERROR`) {
		t.Fatalf("the key was not logged escaped:\n%s", buf.String())
	}
}

// TestGoexitInHandler: a handler that calls runtime.Goexit (t.FailNow in a test's handler)
// ends its goroutine; the delivery is settled as abandoned (the Observer is told), and no
// attempt is recorded.
func TestGoexitInHandler(t *testing.T) {
	store := storetest.NewMemStore()
	rec := &recorder{}
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing", Observer: rec,
		DeadLetterPublisher: &memPublisher{}, DeadLetterTopic: "dead", MaxAttempts: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := ib.Middleware(func(*message.Message) ([]*message.Message, error) {
		runtime.Goexit()
		return nil, nil
	})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = h(message.NewMessage("m-goexit", []byte("{}")))
	}()
	<-done
	if got := rec.outcomes(); len(got) != 1 || got[0] != inbox.OutcomeFailedRetryable {
		t.Fatalf("outcomes %v, want one failed_retryable", got)
	}
	if r := store.Records(); len(r) != 0 {
		t.Fatalf("records %+v, want none: a Goexit is no failure of the message", r)
	}
}
