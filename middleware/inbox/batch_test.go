package inbox_test

// The batched mode (Config.Batch, group commit) on the real PostgreSQL: business state,
// inbox rows, attempt records and each delivery's outcome, in both designs.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

var batchModes = []inbox.BatchMode{inbox.BatchOptimistic, inbox.BatchSavepoints}

// withBatch turns the batched mode on with a linger long enough for a test's concurrent
// deliveries to meet in one batch.
func withBatch(size int, mode inbox.BatchMode) func(*inbox.Config) {
	return func(c *inbox.Config) {
		c.Batch = inbox.BatchConfig{Size: size, Linger: 500 * time.Millisecond, Mode: mode}
	}
}

// deliverAll delivers msgs at the same moment, one goroutine each, and returns each
// delivery's error; a panic is returned as an error starting with "panic: ".
func deliverAll(h message.HandlerFunc, msgs ...*message.Message) []error {
	errs := make([]error, len(msgs))
	var wg sync.WaitGroup
	for k, m := range msgs {
		wg.Go(func() {
			defer func() {
				if p := recover(); p != nil {
					errs[k] = fmt.Errorf("panic: %v", p)
				}
			}()
			errs[k] = deliver(h, m)
		})
	}
	wg.Wait()
	return errs
}

// txRecorder wraps a handler and records, per message UUID, the transaction ID it ran in.
type txRecorder struct {
	mu  sync.Mutex
	txs map[string][]int64
}

func (r *txRecorder) wrap(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := pgstore.TxFromContext(msg.Context())
		var id int64
		if err := tx.QueryRow(msg.Context(), "SELECT txid_current()").Scan(&id); err != nil {
			return nil, err
		}
		r.mu.Lock()
		if r.txs == nil {
			r.txs = map[string][]int64{}
		}
		r.txs[msg.UUID] = append(r.txs[msg.UUID], id)
		r.mu.Unlock()
		return h(msg)
	}
}

func (r *txRecorder) distinct() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	seen := map[int64]bool{}
	for _, ids := range r.txs {
		for _, id := range ids {
			seen[id] = true
		}
	}
	return len(seen)
}

func (r *txRecorder) runs(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.txs[id])
}

// TestBatchedSharesOneTransaction: eight concurrent deliveries share one transaction and one
// commit; the redeliveries of all eight are duplicates; two copies of one new message
// delivered at the same moment (the same key twice in a gathering batch) apply once.
func TestBatchedSharesOneTransaction(t *testing.T) {
	forEachLayout(t, func(t *testing.T, l storeLayout) {
		for _, mode := range batchModes {
			t.Run(mode.String(), func(t *testing.T) {
				e := newLayoutEnv(t, 6, l)
				rec := &recorder{}
				ib := e.inbox("billing", withBatch(8, mode), func(c *inbox.Config) { c.Observer = rec })
				txs := &txRecorder{}
				h := ib.Middleware(txs.wrap(e.credit))
				var msgs []*message.Message
				var want int64
				for k := range 8 {
					msgs = append(msgs, paymentMsg(fmt.Sprintf("pay-%d", k), 1, int64(1)<<k))
					want += int64(1) << k
				}
				for k, err := range deliverAll(h, msgs...) {
					if err != nil {
						t.Fatalf("delivery %d: %v", k, err)
					}
				}
				if n := txs.distinct(); n != 1 {
					t.Fatalf("8 concurrent deliveries ran in %d transactions, want 1 (one batch)", n)
				}
				if got := e.balance(1); got != want {
					t.Fatalf("balance %d, want %d", got, want)
				}
				// The redeliveries, and two copies of a new message in the same wave.
				again := append([]*message.Message{}, msgs...)
				again = append(again, paymentMsg("pay-new", 2, 7), paymentMsg("pay-new", 2, 7))
				for k, err := range deliverAll(h, again...) {
					if err != nil {
						t.Fatalf("redelivery %d: %v", k, err)
					}
				}
				if got, got2 := e.balance(1), e.balance(2); got != want || got2 != 7 {
					t.Fatalf("balances %d and %d after the redeliveries, want %d and 7", got, got2, want)
				}
				if n := e.rows(""); n != 9 {
					t.Fatalf("inbox rows %d, want 9", n)
				}
				if r := txs.runs("pay-new"); r != 1 {
					t.Fatalf("handler runs of the message delivered twice at once: %d, want 1", r)
				}
				st := ib.Stats()
				if st.Processed != 9 || st.Duplicates != 9 || st.Failed != 0 {
					t.Fatalf("stats %+v, want 9 processed, 9 duplicates", st)
				}
				outcomes := map[inbox.Outcome]int{}
				for _, o := range rec.outcomes() {
					outcomes[o]++
				}
				if outcomes[inbox.OutcomeProcessed] != 9 || outcomes[inbox.OutcomeDuplicate] != 9 || len(rec.outcomes()) != 18 {
					t.Fatalf("observed outcomes %v, want one per delivery: 9 processed, 9 duplicates", outcomes)
				}
			})
		}
	})
}

// TestBatchedFailingMember: one handler in a batch fails. Only its message is nacked and
// counted (attempt 1, its error recorded); the others commit once. With savepoints the others
// run once; optimistically the members that ran before the failure run again, alone. The
// poison message then fails in two more batches and is dead-lettered after exactly
// MaxAttempts handler runs.
//
// It runs with no redelivery signal (every member counted before its handler, as on Kafka) and
// with a signal that calls every delivery a first one (counted only when it fails, as a first
// delivery on RabbitMQ).
func TestBatchedFailingMember(t *testing.T) {
	forEachLayout(t, func(t *testing.T, l storeLayout) {
		signals := map[string]inbox.RedeliveryFunc{
			"unknown": nil,
			"first":   func(*message.Message) inbox.Redelivery { return inbox.FirstDelivery },
		}
		for _, mode := range batchModes {
			for signal, redelivery := range signals {
				t.Run(mode.String()+"/"+signal, func(t *testing.T) { testBatchedFailingMember(t, l, mode, redelivery) })
			}
		}
	})
}

func testBatchedFailingMember(t *testing.T, l storeLayout, mode inbox.BatchMode, redelivery inbox.RedeliveryFunc) {
	e := newLayoutEnv(t, 6, l)
	dl := &memPublisher{}
	rec := &recorder{}
	ib := e.inbox("billing", withBatch(6, mode), func(c *inbox.Config) {
		c.DeadLetterPublisher, c.DeadLetterTopic, c.MaxAttempts, c.Observer = dl, "dead", 3, rec
		c.Redelivery = redelivery
	})
	txs := &txRecorder{}
	h := ib.Middleware(txs.wrap(func(msg *message.Message) ([]*message.Message, error) {
		if strings.HasPrefix(msg.UUID, "z-poison") {
			return nil, errors.New("account frozen")
		}
		return e.credit(msg)
	}))
	wave := func(prefix string) []*message.Message {
		var ms []*message.Message
		for k := range 5 {
			ms = append(ms, paymentMsg(fmt.Sprintf("%s-%d", prefix, k), 1, 1))
		}
		return append(ms, paymentMsg("z-poison", 1, 1000)) // sorts last in its batch
	}
	for w, prefix := range []string{"a", "b", "c"} {
		errs := deliverAll(h, wave(prefix)...)
		for k, err := range errs[:5] {
			if err != nil {
				t.Fatalf("wave %d: healthy delivery %d failed: %v", w, k, err)
			}
		}
		poisonErr := errs[5]
		attempts := queryAttempts(t, e, "z-poison")
		if w < 2 {
			if poisonErr == nil || !strings.Contains(poisonErr.Error(), "account frozen") {
				t.Fatalf("wave %d: the failing delivery returned %v, want its error (nack)", w, poisonErr)
			}
			if attempts != w+1 {
				t.Fatalf("wave %d: attempts of the failing message %d, want %d", w, attempts, w+1)
			}
		} else if poisonErr != nil {
			t.Fatalf("wave %d: the dead-lettered delivery returned %v, want nil (ack)", w, poisonErr)
		}
		if got, want := e.balance(1), int64(5*(w+1)); got != want {
			t.Fatalf("wave %d: balance %d, want %d (each healthy payment once, the poison never)", w, got, want)
		}
	}
	if n := txs.runs("z-poison"); n != 3 {
		t.Fatalf("handler runs of the poison message %d, want 3 (MaxAttempts)", n)
	}
	if len(dl.msgs) != 1 || dl.msgs[0].UUID != "z-poison" {
		t.Fatalf("dead letters %d, want 1 (z-poison)", len(dl.msgs))
	}
	if n := e.rows(""); n != 15 {
		t.Fatalf("inbox rows %d, want 15 (the healthy payments)", n)
	}
	wantRuns := 1
	if mode == inbox.BatchOptimistic {
		wantRuns = 2 // in the rolled-back batch, then alone
	}
	for _, id := range []string{"a-0", "b-4", "c-2"} {
		if n := txs.runs(id); n != wantRuns {
			t.Fatalf("handler runs of %s: %d, want %d", id, n, wantRuns)
		}
	}
	if st := ib.Stats(); st.Processed != 15 || st.DeadLettered != 1 || st.Failed != 2 {
		t.Fatalf("stats %+v, want 15 processed, 2 failed, 1 dead-lettered", st)
	}
	if n := len(rec.outcomes()); n != 18 {
		t.Fatalf("%d outcomes observed, want 18 (one per delivery)", n)
	}
}

// queryAttempts returns the recorded attempt count of a billing message (0 without a record).
func queryAttempts(t *testing.T, e *env, id string) int {
	t.Helper()
	var n int
	err := e.sch.Pool.QueryRow(context.Background(), "SELECT coalesce((SELECT attempts FROM "+e.store.AttemptsTable()+" WHERE message_id = $1 AND consumer_name = 'billing'), 0)", e.key(id)).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestBatchedDeadlockBetweenBatchesRetries: two batches update two accounts in opposite
// orders; PostgreSQL breaks the deadlock (40P01) by failing one, which rolls back and runs
// again as a batch: every payment applied once, nothing nacked, no attempt counted.
func TestBatchedDeadlockBetweenBatchesRetries(t *testing.T) {
	forEachLayout(t, func(t *testing.T, l storeLayout) {
		for _, mode := range batchModes {
			t.Run(mode.String(), func(t *testing.T) {
				e := newLayoutEnv(t, 6, l)
				ib := e.inbox("billing", withBatch(2, mode), func(c *inbox.Config) {
					c.DeadLetterPublisher, c.DeadLetterTopic = &memPublisher{}, "dead"
				})
				h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					out, err := e.credit(msg)
					time.Sleep(150 * time.Millisecond) // hold the row lock while the other batch takes its first
					return out, err
				})
				// Batch A: a1 credits account 3, then a2 account 4. Batch B: b1 account 4, then b2
				// account 3.
				var wg sync.WaitGroup
				var errs [2][]error
				wg.Go(func() { errs[0] = deliverAll(h, paymentMsg("a1", 3, 1), paymentMsg("a2", 4, 10)) })
				time.Sleep(20 * time.Millisecond)
				wg.Go(func() { errs[1] = deliverAll(h, paymentMsg("b1", 4, 100), paymentMsg("b2", 3, 1000)) })
				wg.Wait()
				for _, es := range errs {
					for _, err := range es {
						if err != nil {
							t.Fatalf("a delivery failed: %v", err)
						}
					}
				}
				if b3, b4 := e.balance(3), e.balance(4); b3 != 1001 || b4 != 110 {
					t.Fatalf("balances %d and %d, want 1001 and 110", b3, b4)
				}
				st := ib.Stats()
				if st.Processed != 4 || st.TxRetries < 2 {
					t.Fatalf("stats %+v, want 4 processed and the deadlocked batch's 2 members retried", st)
				}
				var left int
				_ = e.sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+e.store.AttemptsTable()).Scan(&left)
				if left != 0 {
					t.Fatalf("%d attempt records left: a deadlock is no attempt", left)
				}
			})
		}
	})
}

// TestBatchedSwallowedStatementError: a handler whose statement fails but which returns nil
// leaves the transaction aborted; the batch sees it at once and fails that member, not the
// next one, and the others' payments commit.
func TestBatchedSwallowedStatementError(t *testing.T) {
	forEachLayout(t, func(t *testing.T, l storeLayout) {
		for _, mode := range batchModes {
			t.Run(mode.String(), func(t *testing.T) {
				e := newLayoutEnv(t, 6, l)
				ib := e.inbox("billing", withBatch(4, mode))
				h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					if msg.UUID == "m-2-swallow" {
						tx, _ := pgstore.TxFromContext(msg.Context())
						_, _ = tx.Exec(msg.Context(), "SELECT 1/0") // the error is swallowed
						return nil, nil
					}
					return e.credit(msg)
				})
				errs := deliverAll(h, paymentMsg("m-1", 5, 1), paymentMsg("m-2-swallow", 5, 10), paymentMsg("m-3", 5, 100), paymentMsg("m-4", 5, 1000))
				for k, err := range errs {
					if (k == 1) != (err != nil) {
						t.Fatalf("delivery %d returned %v; only the swallowing handler's delivery must fail", k, err)
					}
				}
				if b := e.balance(5); b != 1101 {
					t.Fatalf("balance %d, want 1101", b)
				}
				if n := e.rows("message_id::text = $1", e.key("m-2-swallow")); n != 0 {
					t.Fatal("the swallowing delivery was marked processed")
				}
			})
		}
	})
}

// TestBatchedCommitRolledBack: a deferred constraint fails the batch's COMMIT; nothing says
// whose write broke it, so every member runs again alone: the culprit fails (its own COMMIT),
// the others commit once.
func TestBatchedCommitRolledBack(t *testing.T) {
	forEachLayout(t, func(t *testing.T, l storeLayout) {
		e := newLayoutEnv(t, 6, l)
		e.exec("CREATE TABLE uniq (v int, CONSTRAINT uniq_v UNIQUE (v) DEFERRABLE INITIALLY DEFERRED); INSERT INTO uniq VALUES (1)")
		ib := e.inbox("billing", withBatch(3, inbox.BatchOptimistic))
		txs := &txRecorder{}
		h := ib.Middleware(txs.wrap(func(msg *message.Message) ([]*message.Message, error) {
			if msg.UUID == "m-dup-value" {
				tx, _ := pgstore.TxFromContext(msg.Context())
				if _, err := tx.Exec(msg.Context(), "INSERT INTO uniq VALUES (1)"); err != nil {
					return nil, err
				}
			}
			return e.credit(msg)
		}))
		errs := deliverAll(h, paymentMsg("m-a", 6, 1), paymentMsg("m-dup-value", 6, 10), paymentMsg("m-c", 6, 100))
		if errs[0] != nil || errs[2] != nil || !errors.Is(errs[1], inbox.ErrCommitRolledBack) {
			t.Fatalf("errors %v; want only the culprit's delivery to fail, with ErrCommitRolledBack", errs)
		}
		if b := e.balance(6); b != 101 {
			t.Fatalf("balance %d, want 101", b)
		}
		for _, id := range []string{"m-a", "m-dup-value", "m-c"} {
			if n := txs.runs(id); n != 2 {
				t.Fatalf("handler runs of %s: %d, want 2 (the batch, then alone)", id, n)
			}
		}
	})
}

// TestBatchedPanicInAMember: a panicking handler in a batch panics on its own delivery's
// goroutine (the router's Recoverer sees it); the others commit.
func TestBatchedPanicInAMember(t *testing.T) {
	forEachLayout(t, func(t *testing.T, l storeLayout) {
		for _, mode := range batchModes {
			t.Run(mode.String(), func(t *testing.T) {
				e := newLayoutEnv(t, 6, l)
				ib := e.inbox("billing", withBatch(3, mode))
				h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					if msg.UUID == "m-panic" {
						panic("boom")
					}
					return e.credit(msg)
				})
				errs := deliverAll(h, paymentMsg("m-1", 7, 1), paymentMsg("m-panic", 7, 10), paymentMsg("m-3", 7, 100))
				if errs[0] != nil || errs[2] != nil || errs[1] == nil || !strings.HasPrefix(errs[1].Error(), "panic: boom") {
					t.Fatalf("errors %v; want the panic on its own delivery only", errs)
				}
				if b := e.balance(7); b != 101 {
					t.Fatalf("balance %d, want 101", b)
				}
			})
		}
	})
}

// TestBatchedOnMemStore: the batched mode on the in-memory reference store, both designs: a
// failing member's writes are discarded, the others' committed, the outcomes per delivery.
func TestBatchedOnMemStore(t *testing.T) {
	for _, mode := range batchModes {
		t.Run(mode.String(), func(t *testing.T) {
			store := storetest.NewMemStore()
			dl := &memPublisher{}
			ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing", Batch: inbox.BatchConfig{Size: 4, Linger: 100 * time.Millisecond, Mode: mode},
				DeadLetterPublisher: dl, DeadLetterTopic: "dead", MaxAttempts: 2}, nil)
			if err != nil {
				t.Fatal(err)
			}
			h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := storetest.MemTxFromContext(msg.Context())
				tx.Add("balance", 1)
				if msg.UUID == "m-bad" {
					return nil, errors.New("boom")
				}
				return nil, nil
			})
			for wave := range 2 {
				msgs := []*message.Message{message.NewMessage(fmt.Sprintf("m-%d-a", wave), nil), message.NewMessage("m-bad", nil), message.NewMessage(fmt.Sprintf("m-%d-c", wave), nil)}
				errs := deliverAll(h, msgs...)
				if errs[0] != nil || errs[2] != nil || (wave == 0) != (errs[1] != nil) {
					t.Fatalf("wave %d: errors %v", wave, errs)
				}
			}
			if v := store.Value("balance"); v != 4 {
				t.Fatalf("balance %d, want 4 (the failing member's writes discarded)", v)
			}
			if len(dl.msgs) != 1 || store.Processed(inbox.Key{MessageID: "m-bad", ConsumerName: "billing"}) {
				t.Fatalf("dead letters %d, m-bad processed %v; want 1 dead letter after 2 attempts", len(dl.msgs), store.Processed(inbox.Key{MessageID: "m-bad", ConsumerName: "billing"}))
			}
		})
	}
}

// TestBatchConfigValidated: Batch settings are checked by New.
func TestBatchConfigValidated(t *testing.T) {
	for name, cfg := range map[string]inbox.Config{
		"negative size":   {Store: storetest.NewMemStore(), ConsumerName: "c", Batch: inbox.BatchConfig{Size: -1}},
		"negative linger": {Store: storetest.NewMemStore(), ConsumerName: "c", Batch: inbox.BatchConfig{Size: 4, Linger: -time.Millisecond}},
		"too big":         {Store: storetest.NewMemStore(), ConsumerName: "c", Batch: inbox.BatchConfig{Size: inbox.MaxBatchSize + 1}},
		"unknown mode":    {Store: storetest.NewMemStore(), ConsumerName: "c", Batch: inbox.BatchConfig{Size: 4, Mode: 7}},
	} {
		if _, err := inbox.New(cfg, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("%s: New = %v, want ErrInvalidConfig", name, err)
		}
	}
}

// TestBatchedSerializationFailureRetries: under SERIALIZABLE, two batches whose handlers read
// both accounts and write one each (write skew) conflict; PostgreSQL fails one with 40001 (at a
// statement or at COMMIT), and that batch runs again as a whole: every payment applied once,
// nothing nacked.
func TestBatchedSerializationFailureRetries(t *testing.T) {
	forEachLayout(t, func(t *testing.T, l storeLayout) {
		for _, mode := range batchModes {
			t.Run(mode.String(), func(t *testing.T) {
				e := newLayoutEnv(t, 6, l)
				ib := e.inbox("billing", withBatch(2, mode), func(c *inbox.Config) { c.Isolation = sql.LevelSerializable })
				h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					tx, _ := pgstore.TxFromContext(msg.Context())
					var sum int64
					if err := tx.QueryRow(msg.Context(), "SELECT coalesce(sum(balance), 0) FROM accounts WHERE id IN (8, 9)").Scan(&sum); err != nil {
						return nil, err
					}
					time.Sleep(100 * time.Millisecond) // both batches read before either writes
					return e.credit(msg)
				})
				var wg sync.WaitGroup
				var errs [2][]error
				wg.Go(func() { errs[0] = deliverAll(h, paymentMsg("s-a1", 8, 1), paymentMsg("s-a2", 8, 10)) })
				wg.Go(func() { errs[1] = deliverAll(h, paymentMsg("s-b1", 9, 100), paymentMsg("s-b2", 9, 1000)) })
				wg.Wait()
				for _, es := range errs {
					for _, err := range es {
						if err != nil {
							t.Fatalf("a delivery failed: %v", err)
						}
					}
				}
				if b8, b9 := e.balance(8), e.balance(9); b8 != 11 || b9 != 1100 {
					t.Fatalf("balances %d and %d, want 11 and 1100", b8, b9)
				}
				if st := ib.Stats(); st.Processed != 4 || st.TxRetries < 2 {
					t.Fatalf("stats %+v, want 4 processed and one batch's 2 members retried after 40001", st)
				}
			})
		}
	})
}
