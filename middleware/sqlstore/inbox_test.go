package sqlstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/sqlstore"
)

// The inbox middleware on sqlstore, each test on both dialects, asserting rows and balances.

// bank is an env with a migrated store and an accounts table (ids 1 to 3, balance 0).
type bank struct {
	*env
	t     *testing.T
	store *sqlstore.Store
}

func newBank(t *testing.T, d sqlstore.Dialect, conns int) *bank {
	e := newEnv(t, d, conns)
	b := &bank{env: e, t: t, store: e.store(t, sqlstore.Config{})}
	e.exec(t, "CREATE TABLE accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL)")
	e.exec(t, "INSERT INTO accounts (id, balance) VALUES (1, 0), (2, 0), (3, 0)")
	return b
}

func (b *bank) inbox(mod ...func(*inbox.Config)) *inbox.Inbox {
	b.t.Helper()
	cfg := inbox.Config{Store: b.store, ConsumerName: "billing", TxRetryBackoff: time.Millisecond}
	for _, m := range mod {
		m(&cfg)
	}
	ib, err := inbox.New(cfg, nil)
	if err != nil {
		b.t.Fatal(err)
	}
	return ib
}

// credit adds amount to account id in the inbox transaction.
func (b *bank) credit(msg *message.Message, id int, amount int64) error {
	tx, ok := sqlstore.TxFromContext(msg.Context())
	if !ok {
		return errors.New("no inbox transaction in the context")
	}
	_, err := tx.ExecContext(msg.Context(), "UPDATE accounts SET balance = balance + "+b.ph(1)+" WHERE id = "+b.ph(2), amount, id)
	return err
}

func (b *bank) balance(id int) int64 {
	b.t.Helper()
	return int64(b.count(b.t, "SELECT balance FROM accounts WHERE id = "+b.ph(1), id))
}

// deliver runs one delivery of a copy of msg through h, with a fresh context.
func deliver(h message.NoPublishHandlerFunc, msg *message.Message) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m := msg.Copy()
	m.SetContext(ctx)
	return h(m)
}

func wrap(ib *inbox.Inbox, f func(msg *message.Message) error) message.NoPublishHandlerFunc {
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) { return nil, f(msg) })
	return func(msg *message.Message) error { _, err := h(msg); return err }
}

func TestInboxProcessesOnceAndSkipsDuplicates(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		b := newBank(t, d, 12)
		ib := b.inbox()
		h := wrap(ib, func(msg *message.Message) error { return b.credit(msg, 1, 100) })
		msg := message.NewMessage("pay-1", []byte(`{}`))
		for range 3 {
			if err := deliver(h, msg); err != nil {
				t.Fatal(err)
			}
		}
		// Eight copies at once: one runs, the others wait for it and skip.
		var wg sync.WaitGroup
		msg2 := message.NewMessage("pay-2", []byte(`{}`))
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := deliver(h, msg2); err != nil {
					t.Error(err)
				}
			}()
		}
		wg.Wait()
		if got := b.balance(1); got != 200 {
			t.Fatalf("balance %d, want 200 (each message once)", got)
		}
		if n := processedRows(t, b.store); n != 2 {
			t.Fatalf("%d inbox rows, want 2", n)
		}
		if s := ib.Stats(); s.Processed != 2 || s.Duplicates != 9 {
			t.Fatalf("stats %+v, want 2 processed and 9 duplicates", s)
		}
	})
}

func TestInboxHandlerErrorRolledBackAndRetried(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		b := newBank(t, d, 8)
		ib := b.inbox()
		fail := true
		h := wrap(ib, func(msg *message.Message) error {
			if err := b.credit(msg, 1, 100); err != nil {
				return err
			}
			if fail {
				fail = false
				return errors.New("downstream refused")
			}
			return nil
		})
		msg := message.NewMessage("pay-1", []byte(`{}`))
		if err := deliver(h, msg); err == nil {
			t.Fatal("the failing delivery was not failed")
		}
		if got, n := b.balance(1), processedRows(t, b.store); got != 0 || n != 0 {
			t.Fatalf("after the failure: balance %d, %d rows; want 0, 0 (rolled back)", got, n)
		}
		if err := deliver(h, msg); err != nil {
			t.Fatal(err)
		}
		if err := deliver(h, msg); err != nil {
			t.Fatal(err)
		}
		if got, n := b.balance(1), processedRows(t, b.store); got != 100 || n != 1 {
			t.Fatalf("after the redeliveries: balance %d, %d rows; want 100, 1", got, n)
		}
	})
}

// TestInboxRetriesATransientConflict: a handler that hits the dialect's transient conflict
// (MySQL 1213, PostgreSQL 40001) once is retried in process from the claim, and its effect
// happens once.
func TestInboxRetriesATransientConflict(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		b := newBank(t, d, 8)
		ib := b.inbox()
		var conflict error = &pgconn.PgError{Code: "40001"}
		if d == sqlstore.MySQL {
			conflict = &mysql.MySQLError{Number: 1213, Message: "Deadlock found when trying to get lock"}
		}
		runs := 0
		h := wrap(ib, func(msg *message.Message) error {
			runs++
			if err := b.credit(msg, 1, 100); err != nil {
				return err
			}
			if runs == 1 {
				return fmt.Errorf("credit: %w", conflict)
			}
			return nil
		})
		if err := deliver(h, message.NewMessage("pay-1", []byte(`{}`))); err != nil {
			t.Fatal(err)
		}
		if got, n := b.balance(1), processedRows(t, b.store); got != 100 || n != 1 || runs != 2 {
			t.Fatalf("balance %d, %d rows, %d runs; want 100, 1, 2", got, n, runs)
		}
		if s := ib.Stats(); s.TxRetries != 1 {
			t.Fatalf("stats %+v, want 1 retry", s)
		}
	})
}

// dlq is a dead-letter publisher that keeps what it is given.
type dlq struct {
	mu   sync.Mutex
	msgs []*message.Message
}

func (p *dlq) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.msgs = append(p.msgs, msgs...)
	return nil
}

func (p *dlq) Close() error { return nil }

func (p *dlq) len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.msgs)
}

// TestInboxDeadLetterAfterMaxAttempts: a handler that always fails runs MaxAttempts times
// (counted durably in the attempts table); the next delivery is dead-lettered and acked, and
// later ones are acked without running the handler. Nothing of the failed runs committed.
func TestInboxDeadLetterAfterMaxAttempts(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		b := newBank(t, d, 8)
		pub := &dlq{}
		ib := b.inbox(func(c *inbox.Config) {
			c.DeadLetterPublisher, c.DeadLetterTopic, c.MaxAttempts = pub, "dead", 3
		})
		runs := 0
		h := wrap(ib, func(msg *message.Message) error {
			runs++
			if err := b.credit(msg, 1, 100); err != nil {
				return err
			}
			return errors.New("poison")
		})
		msg := message.NewMessage("pay-1", []byte(`{}`))
		for k := range 2 {
			if err := deliver(h, msg); err == nil {
				t.Fatalf("delivery %d: acked, want nacked", k+1)
			}
			if n, _ := attemptsRow(t, b.store, d, msgKey("pay-1")); n != k+1 {
				t.Fatalf("after delivery %d: %d attempts recorded", k+1, n)
			}
		}
		// The third failure uses up the last attempt: dead-lettered, then acked; later
		// deliveries are acked without running the handler.
		for range 3 {
			if err := deliver(h, msg); err != nil {
				t.Fatalf("the exhausted delivery: %v, want acked after the dead letter", err)
			}
		}
		if n, _ := attemptsRow(t, b.store, d, msgKey("pay-1")); n != 3 {
			t.Fatalf("%d attempts recorded, want 3", n)
		}
		if runs != 3 || pub.len() != 1 {
			t.Fatalf("%d runs, %d dead letters; want 3, 1", runs, pub.len())
		}
		if got, n := b.balance(1), processedRows(t, b.store); got != 0 || n != 0 {
			t.Fatalf("balance %d, %d rows; want 0, 0", got, n)
		}
		dead := b.count(t, "SELECT count(*) FROM "+b.store.AttemptsTable()+" WHERE dead_lettered_at IS NOT NULL")
		if dead != 1 {
			t.Fatalf("%d dead-lettered records, want 1", dead)
		}
		// Replayed, it runs again: a fixed handler now processes it once.
		if ok, err := b.store.Replay(ctxT(t), msgKey("pay-1")); err != nil || !ok {
			t.Fatalf("replay: %v %v", ok, err)
		}
		fixed := wrap(ib, func(msg *message.Message) error { return b.credit(msg, 1, 100) })
		if err := deliver(fixed, msg); err != nil {
			t.Fatal(err)
		}
		if got := b.balance(1); got != 100 {
			t.Fatalf("balance %d after the replay, want 100", got)
		}
	})
}

// TestInboxHandlerThatEndsTheTransaction: a handler that commits or rolls back the inbox's
// *sql.Tx itself, or runs a COMMIT or ROLLBACK statement, fails with inbox.ErrTxEnded and is
// never acked as processed; a commit by the handler committed its claim with its writes, so
// the redelivery is a duplicate and the effect happens once.
func TestInboxHandlerThatEndsTheTransaction(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		b := newBank(t, d, 8)
		ib := b.inbox()
		for k, c := range []struct {
			name    string
			end     func(msg *message.Message) error
			applied int64 // the balance change that survives
		}{
			{"Commit", func(msg *message.Message) error { tx, _ := sqlstore.TxFromContext(msg.Context()); return tx.Commit() }, 100},
			{"Rollback", func(msg *message.Message) error { tx, _ := sqlstore.TxFromContext(msg.Context()); return tx.Rollback() }, 0},
			{"COMMIT statement", func(msg *message.Message) error {
				tx, _ := sqlstore.TxFromContext(msg.Context())
				_, err := tx.ExecContext(msg.Context(), "COMMIT")
				return err
			}, 100},
			{"ROLLBACK statement", func(msg *message.Message) error {
				tx, _ := sqlstore.TxFromContext(msg.Context())
				_, err := tx.ExecContext(msg.Context(), "ROLLBACK")
				return err
			}, 0},
		} {
			id := k + 1
			before := b.balance(id%3 + 1)
			h := wrap(ib, func(msg *message.Message) error {
				if err := b.credit(msg, id%3+1, 100); err != nil {
					return err
				}
				_ = c.end(msg) // the handler swallows what ending its transaction returned
				return nil
			})
			msg := message.NewMessage(fmt.Sprintf("end-%d", id), []byte(`{}`))
			if err := deliver(h, msg); !errors.Is(err, inbox.ErrTxEnded) {
				t.Fatalf("%s: %v, want ErrTxEnded", c.name, err)
			}
			if got := b.balance(id%3+1) - before; got != c.applied {
				t.Fatalf("%s: balance moved by %d, want %d", c.name, got, c.applied)
			}
			if c.applied == 0 {
				// Rolled back: the redelivery runs and commits.
				ok := wrap(ib, func(msg *message.Message) error { return b.credit(msg, id%3+1, 100) })
				if err := deliver(ok, msg); err != nil {
					t.Fatalf("%s: redelivery: %v", c.name, err)
				}
			} else if err := deliver(h, msg); err != nil {
				t.Fatalf("%s: redelivery: %v, want a duplicate, acked", c.name, err)
			}
			if got := b.balance(id%3+1) - before; got != 100 {
				t.Fatalf("%s: balance moved by %d in all, want 100 (once)", c.name, got)
			}
		}
	})
}

// TestInboxBatched: in the batched mode (both batch modes), concurrent deliveries share
// transactions; a failing member is rolled back alone and redelivered, duplicates are skipped,
// and every message's effect happens once.
func TestInboxBatched(t *testing.T) {
	for _, mode := range []inbox.BatchMode{inbox.BatchOptimistic, inbox.BatchSavepoints} {
		t.Run(fmt.Sprint(mode), func(t *testing.T) {
			forEach(t, func(t *testing.T, d sqlstore.Dialect) {
				b := newBank(t, d, 12)
				counted := &batchCounter{Store: b.store}
				ib := b.inbox(func(c *inbox.Config) {
					c.Store = counted
					c.Batch = inbox.BatchConfig{Size: 4, Linger: 20 * time.Millisecond, Mode: mode}
				})
				var mu sync.Mutex
				failed := map[string]bool{}
				h := wrap(ib, func(msg *message.Message) error {
					if err := b.credit(msg, 1, 1); err != nil {
						return err
					}
					mu.Lock()
					defer mu.Unlock()
					if msg.UUID == "m-3" && !failed[msg.UUID] {
						failed[msg.UUID] = true
						return errors.New("boom")
					}
					return nil
				})
				var wg sync.WaitGroup
				var errs sync.Map
				for round := range 2 {
					for k := range 8 {
						wg.Add(1)
						go func() {
							defer wg.Done()
							id := fmt.Sprintf("m-%d", k)
							if err := deliver(h, message.NewMessage(id, []byte(`{}`))); err != nil {
								errs.Store(fmt.Sprintf("%d %s", round, id), err)
							}
						}()
					}
					wg.Wait()
				}
				if _, ok := errs.Load("0 m-3"); !failed["m-3"] || !ok {
					t.Fatal("the failing member was not nacked")
				}
				errs.Range(func(k, v any) bool {
					if k != "0 m-3" {
						t.Errorf("delivery %v: %v", k, v)
					}
					return true
				})
				if s := ib.Stats(); s.Processed != 8 {
					t.Errorf("stats %+v, want 8 processed", s)
				}
				if n := counted.multi.Load(); n == 0 {
					t.Error("no batch of more than one delivery was claimed")
				}
				if got, n := b.balance(1), processedRows(t, b.store); got != 8 || n != 8 {
					t.Fatalf("balance %d, %d rows; want 8, 8 (each message once)", got, n)
				}
			})
		})
	}
}

func msgKey(id string) contract.Key { return contract.Key{MessageID: id, ConsumerName: "billing"} }

// batchCounter counts the batches of more than one delivery claimed through it.
type batchCounter struct {
	*sqlstore.Store
	multi atomic.Int64
}

func (c *batchCounter) ClaimBatch(ctx context.Context, ds []contract.Delivery) (contract.BatchTx, []contract.Claim, error) {
	if len(ds) > 1 {
		c.multi.Add(1)
	}
	return c.Store.ClaimBatch(ctx, ds)
}

// TestOutboxOnSQLStorePostgreSQL: on sqlstore's PostgreSQL dialect the outbox writes its rows
// in the inbox's *sql.Tx: a failed delivery leaves none, a processed one leaves one row per
// produced message with the business write and the claim, and a duplicate produces none again.
func TestOutboxOnSQLStorePostgreSQL(t *testing.T) {
	b := newBank(t, sqlstore.PostgreSQL, 8)
	sep := "?"
	if strings.Contains(b.dsn, "?") {
		sep = "&"
	}
	pool := testenv.NewPool(t, b.dsn+sep+"search_path="+b.schema, 4)
	ocfg := outbox.Config{Schema: b.schema}
	if err := outbox.InitializeSchema(ctxT(t), pool, ocfg); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(ocfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ib := b.inbox(func(c *inbox.Config) { c.Outbox = ob })
	fail := true
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if err := b.credit(msg, 1, 100); err != nil {
			return nil, err
		}
		if fail {
			fail = false
			return []*message.Message{message.NewMessage("out-1", []byte(`{}`))}, errors.New("boom")
		}
		return []*message.Message{message.NewMessage("out-1", []byte(`{"n":1}`)), message.NewMessage("out-2", []byte(`{"n":2}`))}, nil
	})
	outboxRows := func() int { return b.count(t, "SELECT count(*) FROM "+ocfg.MessagesTable()) }
	msg := message.NewMessage("pay-1", []byte(`{}`))
	for k, wantErr := range []bool{true, false, false} {
		m := msg.Copy()
		m.SetContext(inbox.ContextWithPublishTopic(ctxT(t), "ledger"))
		if _, err := h(m); (err != nil) != wantErr {
			t.Fatalf("delivery %d: %v", k+1, err)
		}
		if k == 0 && outboxRows() != 0 {
			t.Fatalf("a failed delivery left %d outbox rows", outboxRows())
		}
	}
	if got, n, o := b.balance(1), processedRows(t, b.store), outboxRows(); got != 100 || n != 1 || o != 2 {
		t.Fatalf("balance %d, %d inbox rows, %d outbox rows; want 100, 1, 2", got, n, o)
	}
	// The rows are watermill-sql's, each a forwarder envelope naming its destination topic,
	// as pgstore's outbox writes them; the relay (tested with pgstore in package outbox)
	// reads them the same way. It is not run here: watermill-sql's PostgreSQL subscriber
	// waits for every older transaction of the cluster, which other tests may hold open.
	var wrong int
	q := "SELECT count(*) FROM " + ocfg.MessagesTable() + " WHERE transaction_id IS NULL OR payload::text NOT LIKE '%ledger%'"
	if err := b.db.QueryRow(q).Scan(&wrong); err != nil || wrong != 0 {
		t.Fatalf("%d outbox rows without a transaction ID or their destination topic (%v)", wrong, err)
	}
}

// TestInboxRetriesARealDeadlock: two deliveries whose handlers update accounts 1 and 2 in
// opposite orders meet in a real deadlock (MySQL 1213; PostgreSQL 40P01 after
// deadlock_timeout); the server rolls one back, the inbox retries it from the claim, and both
// messages' effects happen once.
func TestInboxRetriesARealDeadlock(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		b := newBank(t, d, 8)
		ib := b.inbox()
		var arrived sync.WaitGroup
		arrived.Add(2)
		var firstRuns sync.Map
		h := wrap(ib, func(msg *message.Message) error {
			from, to := 1, 2
			if msg.UUID == "pay-b" {
				from, to = 2, 1
			}
			if err := b.credit(msg, from, 1); err != nil {
				return err
			}
			if _, again := firstRuns.LoadOrStore(msg.UUID, true); !again {
				arrived.Done()
				arrived.Wait() // both hold their first row: the second update deadlocks
			}
			return b.credit(msg, to, 10)
		})
		var wg sync.WaitGroup
		for _, id := range []string{"pay-a", "pay-b"} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := deliver(h, message.NewMessage(id, []byte(`{}`))); err != nil {
					t.Errorf("%s: %v", id, err)
				}
			}()
		}
		wg.Wait()
		if s := ib.Stats(); s.TxRetries < 1 || s.Processed != 2 {
			t.Fatalf("stats %+v, want 2 processed after at least one retry", s)
		}
		if b1, b2, n := b.balance(1), b.balance(2), processedRows(t, b.store); b1 != 11 || b2 != 11 || n != 2 {
			t.Fatalf("balances %d, %d, %d rows; want 11, 11, 2", b1, b2, n)
		}
	})
}

// TestInboxConcurrentCopiesAndFailures: 40 messages, each delivered 3 times by 8 concurrent
// workers in shuffled order, with a dead-letter topic (counting first) and a handler that
// fails every message's first run: every message ends processed exactly once (one row, its
// credit once), none is dead-lettered, and no attempt record is left.
func TestInboxConcurrentCopiesAndFailures(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		b := newBank(t, d, 12)
		pub := &dlq{}
		ib := b.inbox(func(c *inbox.Config) {
			c.DeadLetterPublisher, c.DeadLetterTopic, c.MaxAttempts = pub, "dead", 5
		})
		var mu sync.Mutex
		failedOnce := map[string]bool{}
		h := wrap(ib, func(msg *message.Message) error {
			if err := b.credit(msg, 1, 1); err != nil {
				return err
			}
			mu.Lock()
			defer mu.Unlock()
			if !failedOnce[msg.UUID] {
				failedOnce[msg.UUID] = true
				return errors.New("first run fails")
			}
			return nil
		})
		const messages, copies = 40, 3
		work := make(chan string, messages*copies*2)
		for c := range copies {
			for k := range messages {
				work <- fmt.Sprintf("m-%d", (k*7+c*13)%messages)
			}
		}
		var pending sync.WaitGroup
		pending.Add(messages * copies)
		var wg sync.WaitGroup
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for id := range work {
					if err := deliver(h, message.NewMessage(id, []byte(`{}`))); err != nil {
						work <- id // nacked: redelivered
						continue
					}
					pending.Done()
				}
			}()
		}
		pending.Wait()
		close(work)
		wg.Wait()
		if got, n := b.balance(1), processedRows(t, b.store); got != messages || n != messages {
			t.Fatalf("balance %d, %d rows; want %d, %d (each message once)", got, n, messages, messages)
		}
		if left := b.count(t, "SELECT count(*) FROM "+b.store.AttemptsTable()); left != 0 || pub.len() != 0 {
			t.Fatalf("%d attempt records left, %d dead letters; want none", left, pub.len())
		}
	})
}
