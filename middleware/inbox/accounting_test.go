package inbox_test

// Attempt accounting and the message the inbox works on (issue: "the poison path
// dead-letters healthy messages, and a handler that changes the message breaks exactly-once").
// Every test runs against the real PostgreSQL and asserts balances, ledger rows, dead letters
// and attempt rows.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// redeliveredKey is the metadata flag these tests' "broker" sets on a redelivery; the inbox
// reads it through Config.Redelivery in the "signal" variants.
const redeliveredKey = "test_redelivered"

func redeliveryFromFlag(msg *message.Message) inbox.Redelivery {
	if msg.Metadata.Get(redeliveredKey) == "true" {
		return inbox.Redelivered
	}
	return inbox.FirstDelivery
}

// signals are the two ways the inbox learns about redeliveries: no signal (every delivery is
// counted before its handler) and a trusted broker flag (first deliveries are counted only
// after a failure).
var signals = []struct {
	name string
	mod  func(*inbox.Config)
}{
	{"no-signal", func(*inbox.Config) {}},
	{"broker-signal", func(c *inbox.Config) { c.Redelivery = redeliveryFromFlag }},
}

// redeliverUntilAcked delivers msg as a broker would until the middleware returns nil (an
// ack), flagging every delivery after the first as a redelivery. It gives up after limit
// deliveries and returns how many it made.
func redeliverUntilAcked(t *testing.T, h message.HandlerFunc, msg *message.Message, limit int) int {
	t.Helper()
	for n := 1; n <= limit; n++ {
		m := msg.Copy()
		if n > 1 {
			m.Metadata.Set(redeliveredKey, "true")
		}
		if err := deliver(h, m); err == nil {
			return n
		}
	}
	t.Errorf("message %s not acked after %d deliveries", msg.UUID, limit)
	return limit
}

func (e *env) createLedger() {
	e.exec("CREATE TABLE ledger (message_id text NOT NULL, account int NOT NULL, amount bigint NOT NULL)")
}

// creditWithLedger credits the account and appends a ledger row, in the inbox transaction.
func (e *env) creditWithLedger(msg *message.Message) ([]*message.Message, error) {
	e.runs.Add(1)
	var p payment
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return nil, inbox.Permanent(err)
	}
	tx, _ := pgstore.TxFromContext(msg.Context())
	if _, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + $1 WHERE id = $2", p.Amount, p.Account); err != nil {
		return nil, err
	}
	_, err := tx.Exec(msg.Context(), "INSERT INTO ledger VALUES ($1, $2, $3)", msg.UUID, p.Account, p.Amount)
	return nil, err
}

func (e *env) count(q string, args ...any) int {
	e.t.Helper()
	var n int
	if err := e.sch.Pool.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

func (e *env) attemptRows() int {
	return e.count("SELECT count(*) FROM inbox_processed_messages_attempts")
}

// settled checks the business state once every delivery has settled: account's balance,
// no dead letter published, no attempt row left.
func (e *env) settled(dl *deadLetters, account int, balance int64) {
	e.t.Helper()
	if b := e.balance(account); b != balance {
		e.t.Fatalf("balance %d, want %d", b, balance)
	}
	dl.wait(e.t, 0)
	if r := e.attemptRows(); r != 0 {
		e.t.Fatalf("%d attempt rows left", r)
	}
}

// --- Kind 1: the message the inbox works on is the message it received ---

// TestHandlerChangingTheMessageUnderRetry: a handler that rewrites the message's UUID, its
// idempotency key, its payload or its metadata, credits, then fails; Watermill's Retry sits
// outside the inbox and calls it again; later the broker redelivers the original. The credit
// must be applied once, under the key of the message as received.
func TestHandlerChangingTheMessageUnderRetry(t *testing.T) {
	mutations := map[string]func(m *message.Message){
		"uuid":     func(m *message.Message) { m.UUID = watermill.NewUUID() },
		"key":      func(m *message.Message) { m.Metadata.Set("idempotency_key", "rewritten-"+watermill.NewUUID()) },
		"payload":  func(m *message.Message) { m.Payload = []byte(`{"account":1,"amount":25,"normalised":true}`) },
		"in-place": func(m *message.Message) { copy(m.Payload, []byte(`{"account":2`)) },
		"all": func(m *message.Message) {
			m.UUID = "changed"
			m.Metadata = message.Metadata{"idempotency_key": "changed"}
			m.Payload = []byte(`{"account":3,"amount":1}`)
		},
	}
	for _, keyed := range []string{"uuid-key", "metadata-key"} {
		for name, mutate := range mutations {
			t.Run(keyed+"/"+name, func(t *testing.T) {
				e := newEnv(t, 4)
				e.createLedger()
				dl := newDeadLetters(t)
				mods := []func(*inbox.Config){withDeadLetters(dl, 5)}
				if keyed == "metadata-key" {
					ke, err := inbox.MetadataKey("idempotency_key")
					if err != nil {
						t.Fatal(err)
					}
					mods = append(mods, func(c *inbox.Config) { c.KeyExtractor = ke })
				}
				ib := e.inbox("billing", mods...)
				failOnce := atomic.Bool{}
				h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					mutate(msg)
					out, err := e.creditWithLedger(msg)
					if err == nil && failOnce.CompareAndSwap(false, true) {
						return nil, errors.New("downstream hiccup after the credit")
					}
					return out, err
				})
				retried := wmmiddleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware(h)
				msg := paymentMsg("pay-1", 1, 25)
				msg.Metadata.Set("idempotency_key", "order-77")
				if err := deliver(retried, msg); err != nil {
					t.Fatalf("delivery under Retry: %v", err)
				}
				// The broker redelivers the original (its ack was lost).
				if err := deliver(ib.Middleware(e.creditWithLedger), msg); err != nil {
					t.Fatalf("redelivery: %v", err)
				}
				// One application of the payment, as the handler computed it from its copy.
				if ledger := e.count("SELECT count(*) FROM ledger"); ledger != 1 {
					t.Fatalf("ledger rows %d, want 1", ledger)
				}
				if total, want := e.count("SELECT sum(balance)::int FROM accounts"), e.count("SELECT sum(amount)::int FROM ledger"); total != want {
					t.Fatalf("total balance %d, ledger total %d", total, want)
				}
				wantKey := msg.UUID
				if keyed == "metadata-key" {
					wantKey = "order-77"
				}
				if n := e.rows("message_id = $1", wantKey); n != 1 || e.rows("") != 1 {
					t.Fatalf("inbox rows for the received key %q: %d of %d; the claim must use the message as received", wantKey, n, e.rows(""))
				}
				if e.attemptRows() != 0 {
					t.Fatalf("attempt rows left: %d", e.attemptRows())
				}
				dl.wait(t, 0)
			})
		}
	}
}

// TestDeadLetterCarriesTheReceivedMessage: the handler replaces payload, UUID and metadata and
// returns a permanent error; the dead letter is the message as received.
func TestDeadLetterCarriesTheReceivedMessage(t *testing.T) {
	e := newEnv(t, 2)
	dl := newDeadLetters(t)
	ke, _ := inbox.MetadataKey("idempotency_key")
	ib := e.inbox("billing", withDeadLetters(dl, 5), func(c *inbox.Config) { c.KeyExtractor = ke })
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		msg.UUID = "replaced-uuid"
		msg.Payload = []byte("replaced payload")
		msg.Metadata.Set("idempotency_key", "replaced-key")
		msg.Metadata.Set("stamp", "x")
		return nil, inbox.Permanent(errors.New("malformed"))
	})
	msg := paymentMsg("orig-uuid", 1, 5)
	msg.Metadata.Set("idempotency_key", "orig-key")
	if err := deliver(h, msg); err != nil {
		t.Fatalf("a permanent error with a dead-letter topic must be acked: %v", err)
	}
	got := dl.wait(t, 1)[0]
	if got.UUID != "orig-uuid" || string(got.Payload) != string(msg.Payload) ||
		got.Metadata.Get("idempotency_key") != "orig-key" || got.Metadata.Get("stamp") != "" ||
		got.Metadata.Get(inbox.DeadLetterMessageKeyKey) != "orig-key" {
		t.Fatalf("dead letter = %s %q %v; want the received message", got.UUID, got.Payload, got.Metadata)
	}
	if _, _, dead := e.attemptsRow("orig-key"); !dead {
		t.Fatal("the received key is not marked dead-lettered")
	}
}

// --- Kind 2: only the message's own failures count ---

// TestContentionNeverDeadLetters: 48 concurrent healthy payments to one account under
// REPEATABLE READ and SERIALIZABLE, default attempts, dead letters on, each redelivered until
// acked, with the default in-process retries and with none (every conflict goes back to the
// broker): every payment applied once, no dead letter, no attempt row left.
func TestContentionNeverDeadLetters(t *testing.T) {
	for _, iso := range []sql.IsolationLevel{sql.LevelRepeatableRead, sql.LevelSerializable} {
		for _, sig := range signals {
			for _, retries := range []int{0, -1} {
				t.Run(fmt.Sprintf("%s/%s/retries=%d", iso, sig.name, retries), func(t *testing.T) {
					const n = 48
					e := newEnv(t, n+4)
					e.createLedger()
					dl := newDeadLetters(t)
					ib := e.inbox("billing", withDeadLetters(dl, inbox.DefaultMaxAttempts), sig.mod, func(c *inbox.Config) {
						c.Isolation = iso
						c.MaxTxRetries = retries
					})
					h := ib.Middleware(e.creditWithLedger)
					var wg sync.WaitGroup
					start := make(chan struct{})
					var want int64
					for i := range n {
						amount := int64(i + 1)
						want += amount
						msg := paymentMsg(fmt.Sprintf("pay-%d", i), 1, amount)
						wg.Go(func() {
							<-start
							redeliverUntilAcked(t, h, msg, 200)
						})
					}
					close(start)
					wg.Wait()
					if b := e.balance(1); b != want {
						t.Fatalf("balance %d, want %d", b, want)
					}
					if l := e.count("SELECT count(*) FROM ledger"); l != n {
						t.Fatalf("ledger rows %d, want %d", l, n)
					}
					if s := ib.Stats(); s.DeadLettered != 0 || s.DeadLetteredSkips != 0 {
						t.Fatalf("healthy payments dead-lettered: %+v", s)
					}
					dl.wait(t, 0)
					if r := e.attemptRows(); r != 0 {
						t.Fatalf("%d attempt rows left after every message settled", r)
					}
					if retries < 0 && ib.Stats().Failed == 0 {
						t.Fatal("no delivery met a conflict: the test did not create contention")
					}
				})
			}
		}
	}
}

// TestConcurrentCopiesNeverDeadLetter: 10 copies of one message released together at a
// barrier just before the claim, a handler that never fails, MaxAttempts 5, over 25 rounds
// (a 1-in-20 fault fails this reliably), at each isolation level and with and without a
// redelivery signal: applied once per round, never dead-lettered, no attempt rows left.
func TestConcurrentCopiesNeverDeadLetter(t *testing.T) {
	const copies, rounds = 10, 25
	for _, iso := range []sql.IsolationLevel{sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable} {
		for _, sig := range signals {
			t.Run(fmt.Sprintf("%s/%s", iso, sig.name), func(t *testing.T) {
				e := newEnv(t, copies+4)
				e.createLedger()
				dl := newDeadLetters(t)
				for round := range rounds {
					bs := newBarrierStore(e.store, copies)
					ib := e.inbox("billing", withDeadLetters(dl, 5), sig.mod, func(c *inbox.Config) {
						c.Isolation = iso
						c.Store = bs
					})
					h := ib.Middleware(e.creditWithLedger)
					msg := paymentMsg(fmt.Sprintf("copy-%d", round), 2, 10)
					var wg sync.WaitGroup
					for c := range copies {
						m := msg.Copy()
						if c%2 == 1 {
							m.Metadata.Set(redeliveredKey, "true") // some copies are redeliveries
						}
						wg.Go(func() { redeliverUntilAcked(t, h, m, 50) })
					}
					wg.Wait()
					if s := ib.Stats(); s.DeadLettered != 0 {
						t.Fatalf("round %d: a healthy message was dead-lettered: %+v", round, s)
					}
				}
				if b := e.balance(2); b != 10*rounds {
					t.Fatalf("balance %d, want %d", b, 10*rounds)
				}
				if l := e.count("SELECT count(*) FROM ledger"); l != rounds {
					t.Fatalf("ledger rows %d, want %d", l, rounds)
				}
				dl.wait(t, 0)
				if r := e.attemptRows(); r != 0 {
					t.Fatalf("%d attempt rows left", r)
				}
			})
		}
	}
}

// TestInProcessRetryLeavesNoAttemptRow: a delivery counted before its claim meets a
// serialization failure, is retried in process and commits: its attempt row goes.
func TestInProcessRetryLeavesNoAttemptRow(t *testing.T) {
	e := newEnv(t, 4)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 5), func(c *inbox.Config) { c.Isolation = sql.LevelRepeatableRead })
	conflicted := atomic.Bool{}
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := pgstore.TxFromContext(msg.Context())
		// Read the row (taking the snapshot), then let another transaction change it.
		if _, err := tx.Exec(msg.Context(), "SELECT balance FROM accounts WHERE id = 4"); err != nil {
			return nil, err
		}
		if conflicted.CompareAndSwap(false, true) {
			e.exec("UPDATE accounts SET balance = balance + 1 WHERE id = 4")
		}
		return e.credit(msg)
	})
	if err := deliver(h, paymentMsg("m-rr", 4, 10)); err != nil {
		t.Fatal(err)
	}
	if s := ib.Stats(); s.TxRetries == 0 || s.Processed != 1 {
		t.Fatalf("stats %+v: want a transaction retry, then processed", s)
	}
	if b := e.balance(4); b != 11 {
		t.Fatalf("balance %d, want 11", b)
	}
	if r := e.attemptRows(); r != 0 {
		t.Fatalf("%d attempt rows left after an in-process retry committed", r)
	}
}

// TestShutdownIsNotAnAttempt: dead letters on, MaxAttempts 2; the consumer shuts down twice
// while the handler runs (its message context is cancelled, as Router.Close does), then the
// message is delivered again: applied once, not dead-lettered.
func TestShutdownIsNotAnAttempt(t *testing.T) {
	for _, sig := range signals {
		t.Run(sig.name, func(t *testing.T) {
			e := newEnv(t, 4)
			dl := newDeadLetters(t)
			ib := e.inbox("billing", withDeadLetters(dl, 2), sig.mod)
			h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				select {
				case <-time.After(100 * time.Millisecond):
				case <-msg.Context().Done():
				}
				tx, _ := pgstore.TxFromContext(msg.Context())
				_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 7 WHERE id = 5")
				return nil, err
			})
			msg := paymentMsg("m-deploy", 5, 7)
			for i := range 2 {
				ctx, cancel := context.WithCancel(context.Background())
				m := msg.Copy()
				if i > 0 {
					m.Metadata.Set(redeliveredKey, "true")
				}
				m.SetContext(ctx)
				time.AfterFunc(30*time.Millisecond, cancel)
				if _, err := h(m); err == nil {
					t.Fatalf("shutdown %d: the abandoned delivery was acked", i+1)
				}
				cancel()
			}
			m := msg.Copy()
			m.Metadata.Set(redeliveredKey, "true")
			if err := deliver(h, m); err != nil {
				t.Fatalf("delivery after the restarts: %v", err)
			}
			e.settled(dl, 5, 7)
		})
	}
}

// TestRollbackCertainAtCommitCounts: COMMIT raises a deferred unique violation (SQLSTATE
// 23505): the rollback is certain, so the delivery is the message's failed attempt, counted at
// once, and with MaxAttempts 1 dead-lettered on that very delivery with the real cause.
func TestRollbackCertainAtCommitCounts(t *testing.T) {
	for _, sig := range signals {
		t.Run(sig.name, func(t *testing.T) {
			e := newEnv(t, 3)
			e.exec("CREATE TABLE orders (ref text UNIQUE DEFERRABLE INITIALLY DEFERRED)")
			e.exec("INSERT INTO orders VALUES ('taken')")
			dl := newDeadLetters(t)
			ib := e.inbox("billing", withDeadLetters(dl, 1), sig.mod)
			h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				e.runs.Add(1)
				tx, _ := pgstore.TxFromContext(msg.Context())
				_, err := tx.Exec(msg.Context(), "INSERT INTO orders VALUES ('taken')") // fails only at COMMIT
				return nil, err
			})
			if err := deliver(h, paymentMsg("m-deferred", 1, 1)); err != nil {
				t.Fatalf("dead-lettered delivery must be acked: %v", err)
			}
			if e.runs.Load() != 1 {
				t.Fatalf("handler runs %d, want 1: dead-lettered on the delivery whose commit failed", e.runs.Load())
			}
			r := dl.wait(t, 1)[0].Metadata.Get(wmmiddleware.ReasonForPoisonedKey)
			if !strings.Contains(r, "failed 1 of 1 attempts") || !strings.Contains(r, "23505") {
				t.Fatalf("reason = %q, want the failed attempt and the commit's SQLSTATE", r)
			}
		})
	}
}

// TestReasonsNameTheCause: a panicking handler's dead letter says it panicked; crashes say no
// error was recorded; a handler error is quoted.
func TestReasonsNameTheCause(t *testing.T) {
	e := newEnv(t, 3)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 2))
	panicky := ib.Middleware(func(*message.Message) ([]*message.Message, error) { panic("boom in handler") })
	msg := paymentMsg("m-panic", 1, 1)
	for i := range 2 {
		func() {
			defer func() { _ = recover() }()
			if err := deliver(panicky, msg); err != nil && i == 1 {
				t.Fatalf("the last panic must be dead-lettered and acked: %v", err)
			}
		}()
	}
	r := dl.wait(t, 1)[0].Metadata.Get(wmmiddleware.ReasonForPoisonedKey)
	if !strings.Contains(r, "failed 2 of 2 attempts") || !strings.Contains(r, "panicked: boom in handler") {
		t.Fatalf("reason = %q, want the panic named", r)
	}
	if _, _, dead := e.attemptsRow("m-panic"); !dead {
		t.Fatal("not marked dead-lettered")
	}
}

// TestConfigurationFaultsAreNotAttempts: a handler whose statements fail because of the
// deployment (a missing table, SQLSTATE 42P01; a missing column, 42703; a missing privilege,
// 42501) is nacked without using up an attempt, even with MaxAttempts 1: once the operator
// fixes it, the message is processed.
func TestConfigurationFaultsAreNotAttempts(t *testing.T) {
	for name, stmt := range map[string]string{
		"42P01-undefined-table":  "INSERT INTO not_created_yet VALUES (1)",
		"42703-undefined-column": "UPDATE accounts SET not_a_column = 1 WHERE id = 1",
		"42501-no-privilege":     "INSERT INTO locked_down VALUES (1)",
	} {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, 4)
			e.exec("CREATE TABLE locked_down (x int)")
			role := e.sch.Name + "_ro"
			e.exec("CREATE ROLE " + role)
			t.Cleanup(func() { e.exec("DROP OWNED BY " + role + "; DROP ROLE " + role) })
			e.exec("GRANT USAGE ON SCHEMA " + e.sch.Name + " TO " + role)
			e.exec("GRANT SELECT, INSERT, UPDATE, DELETE ON accounts, inbox_processed_messages, inbox_processed_messages_attempts TO " + role)
			dl := newDeadLetters(t)
			ib := e.inbox("billing", withDeadLetters(dl, 1))
			fixed := false
			h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				tx, _ := pgstore.TxFromContext(msg.Context())
				if !fixed {
					if _, err := tx.Exec(msg.Context(), "SET LOCAL ROLE "+role); err != nil {
						return nil, err
					}
					if _, err := tx.Exec(msg.Context(), stmt); err != nil {
						return nil, err
					}
				}
				_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 3 WHERE id = 1")
				return nil, err
			})
			msg := paymentMsg("m-config", 1, 3)
			for i := range 3 {
				if err := deliver(h, msg); err == nil {
					t.Fatalf("delivery %d acked although its statement failed", i+1)
				}
			}
			if n, _, dead := e.attemptsRow(msg.UUID); n != 0 || dead {
				t.Fatalf("attempts %d, dead-lettered %v after configuration faults; want 0, false", n, dead)
			}
			fixed = true
			if err := deliver(h, msg); err != nil {
				t.Fatalf("after the fix: %v", err)
			}
			if b := e.balance(1); b != 3 {
				t.Fatalf("balance %d, want 3", b)
			}
			dl.wait(t, 0)
		})
	}
}
