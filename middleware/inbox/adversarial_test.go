package inbox_test

// Adversarial tests of the storage contract v2 and the attempt accounting rule
// (docs/design.md, "Attempt accounting: the rule"). Each test runs against the real
// PostgreSQL and asserts business state: balances, inbox rows, attempt rows, dead letters
// and the advisory locks held by the pool's connections.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// advisoryLocks counts the advisory locks held by the pool's idle connections (every
// connection a delivery gave back) plus the key locks of ids held by any session of the
// server (a lock left on a connection being closed, or in another pool).
func (e *env) advisoryLocks(ids ...string) int {
	e.t.Helper()
	ctx := context.Background()
	n := 0
	for _, c := range e.sch.Pool.AcquireAllIdle(ctx) {
		var k int
		err := c.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()").Scan(&k)
		c.Release()
		if err != nil {
			e.t.Fatal(err)
		}
		n += k
	}
	for _, id := range ids {
		// pgstore's key lock: hashtextextended(table, consumer and message ID), split by
		// pg_locks into classid (high 32 bits) and objid (low 32 bits).
		lockKey := e.store.Table() + "\x1f" + "billing" + "\x1f" + id
		n += e.count(`SELECT count(*) FROM pg_locks, (SELECT hashtextextended($1, 0) AS h) k
			WHERE locktype = 'advisory' AND objsubid = 1
			AND classid::bigint = (k.h >> 32) & 4294967295 AND objid::bigint = k.h & 4294967295`, lockKey)
	}
	return n
}

// TestSwallowedStatementErrorIsDeadLettered: a poison message whose handler swallows a failed
// statement (so COMMIT answers ROLLBACK: "a rollback certain at COMMIT", which the rule
// counts) must reach the dead-letter topic after a bounded number of runs, at every isolation
// level, with and without a redelivery signal. Nothing may be applied.
func TestSwallowedStatementErrorIsDeadLettered(t *testing.T) {
	const maxAttempts = 3
	for _, iso := range []sql.IsolationLevel{sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable} {
		for _, sig := range signals {
			t.Run(fmt.Sprintf("%s/%s", iso, sig.name), func(t *testing.T) {
				e := newEnv(t, 3)
				dl := newDeadLetters(t)
				ib := e.inbox("billing", withDeadLetters(dl, maxAttempts), sig.mod, func(c *inbox.Config) { c.Isolation = iso })
				h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					if _, err := e.credit(msg); err != nil {
						return nil, err
					}
					tx, _ := pgstore.TxFromContext(msg.Context())
					// Swallowed: the transaction is aborted, COMMIT will answer ROLLBACK.
					_, _ = tx.Exec(msg.Context(), "INSERT INTO accounts (id, balance) VALUES (1, 0)")
					return nil, nil
				})
				msg := paymentMsg("m-swallow-poison", 3, 5)
				n := redeliverUntilAcked(t, h, msg, 3*maxAttempts)
				if runs, limit := e.runs.Load(), int64(maxAttempts+1); runs > limit {
					t.Errorf("the handler ran %d times (acked after %d deliveries); a poison message must be dead-lettered after at most %d runs", runs, n, limit)
				}
				if s := ib.Stats(); s.DeadLettered != 1 {
					t.Errorf("stats %+v: want the poison message dead-lettered once", s)
				}
				if att, lastErr, dead := e.attemptsRow(msg.UUID); !dead {
					t.Errorf("attempt row (%d, %q, dead=%v): want it marked dead-lettered", att, lastErr, dead)
				}
				if b, r := e.balance(3), e.rows(""); b != 0 || r != 0 {
					t.Errorf("balance %d, inbox rows %d; want 0, 0", b, r)
				}
				if l := e.advisoryLocks(msg.UUID); l != 0 {
					t.Errorf("%d advisory locks held after every delivery ended", l)
				}
			})
		}
	}
}

var _ = errors.New
var _ = strings.Contains
var _ atomic.Bool
var _ = time.Second
var _ = context.Background
var _ = wmmiddleware.ReasonForPoisonedKey

// TestCopyCountedBehindAFirstDeliveryIsNotAFailure: MaxAttempts 2, a trustworthy redelivery
// signal. The first delivery (not counted up front) runs its handler; meanwhile a redelivered
// copy arrives (a consumer timeout, a dropped channel) and waits on the claim. The first run
// fails once; the copy then runs and succeeds. One failure is below the limit: the message
// must be processed once and never dead-lettered ("a message is dead-lettered only for its own
// failures"; "copies waiting behind a running delivery are never counted"), and no attempt
// row may be left.
func TestCopyCountedBehindAFirstDeliveryIsNotAFailure(t *testing.T) {
	const rounds = 5
	e := newEnv(t, 6)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 2), func(c *inbox.Config) { c.Redelivery = redeliveryFromFlag })
	for round := range rounds {
		started, proceed := make(chan struct{}), make(chan struct{})
		var run atomic.Int32
		h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			if run.Add(1) == 1 {
				close(started)
				<-proceed
				if _, err := e.credit(msg); err != nil {
					return nil, err
				}
				return nil, errors.New("transient: downstream timeout")
			}
			return e.credit(msg)
		})
		msg := paymentMsg(fmt.Sprintf("m-copy-behind-first-%d", round), 6, 10)
		first := make(chan error, 1)
		go func() { first <- deliver(h, msg) }()
		<-started
		redelivered := msg.Copy()
		redelivered.Metadata.Set(redeliveredKey, "true")
		second := make(chan error, 1)
		go func() { second <- deliver(h, redelivered) }()
		time.Sleep(300 * time.Millisecond) // the copy reaches the claim and waits on it
		close(proceed)
		errFirst, errSecond := <-first, <-second
		if s := ib.Stats(); s.DeadLettered != 0 {
			_, _, dead := e.attemptsRow(msg.UUID)
			t.Fatalf("round %d: a message that failed once (MaxAttempts 2) was dead-lettered (reason %q) and processed %d time(s), "+
				"attempt row marked dead=%v; first delivery: %v, copy: %v; stats %+v", round,
				dl.wait(t, int(s.DeadLettered))[0].Metadata.Get(wmmiddleware.ReasonForPoisonedKey),
				e.rows("message_id = $1", msg.UUID), dead, errFirst, errSecond, s)
		}
		if errFirst == nil || errSecond != nil {
			t.Fatalf("round %d: first delivery %v (want its error, nacked), copy %v (want acked)", round, errFirst, errSecond)
		}
	}
	if b := e.balance(6); b != 10*rounds {
		t.Fatalf("balance %d, want %d", b, 10*rounds)
	}
	if r := e.attemptRows(); r != 0 {
		t.Fatalf("%d attempt rows left after every message was processed", r)
	}
	dl.wait(t, 0)
}

// TestCountHeldAcrossInProcessRetryIsNotAFailure: no redelivery signal, MaxAttempts 2,
// REPEATABLE READ. Delivery A is counted, meets a serialization failure (40001) and backs off
// before its in-process retry. During the back-off a copy B of the message runs and fails
// once. One failure is below the limit: B must be nacked, and A's retry must process the
// message. A's count, kept across its back-off, must not make B's single failure the
// message's second ("each attempt counts once; a transient conflict is not the message's
// fault").
func TestCountHeldAcrossInProcessRetryIsNotAFailure(t *testing.T) {
	e := newEnv(t, 6)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 2), func(c *inbox.Config) {
		c.Isolation = sql.LevelRepeatableRead
		c.TxRetryBackoff = 600 * time.Millisecond
		c.MaxTxRetryBackoff = 600 * time.Millisecond
	})
	conflicted := make(chan struct{})
	var run atomic.Int32
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		switch run.Add(1) {
		case 1: // A's first try: a serialization failure.
			tx, _ := pgstore.TxFromContext(msg.Context())
			if _, err := tx.Exec(msg.Context(), "SELECT balance FROM accounts WHERE id = 7"); err != nil {
				return nil, err
			}
			e.exec("UPDATE accounts SET balance = balance + 1000 WHERE id = 7")
			_, err := e.credit(msg)
			close(conflicted)
			return nil, err
		case 2: // B, during A's back-off: fails once.
			return nil, errors.New("transient: downstream timeout")
		}
		return e.credit(msg)
	})
	msg := paymentMsg("m-retry-backoff", 7, 10)
	a := make(chan error, 1)
	go func() { a <- deliver(h, msg) }()
	<-conflicted
	errB := deliver(h, msg)
	errA := <-a
	if s := ib.Stats(); s.DeadLettered != 0 || errB == nil || errA != nil {
		reason := ""
		if s.DeadLettered > 0 {
			reason = dl.wait(t, int(s.DeadLettered))[0].Metadata.Get(wmmiddleware.ReasonForPoisonedKey)
		}
		t.Fatalf("one failure with MaxAttempts 2: copy B returned %v (want its error), A returned %v (want processed); "+
			"stats %+v; dead-letter reason %q; balance %d", errB, errA, s, reason, e.balance(7))
	}
	if b, r := e.balance(7), e.rows(""); b != 1010 || r != 1 {
		t.Fatalf("balance %d, inbox rows %d; want 1010 (1000 + one credit), 1", b, r)
	}
	if r := e.attemptRows(); r != 0 {
		t.Fatalf("%d attempt rows left", r)
	}
	if l := e.advisoryLocks(msg.UUID); l != 0 {
		t.Fatalf("%d advisory locks left", l)
	}
}

// TestClaimCancelledWhileWaitingDoesNotCount: with no LockTimeout, a counted delivery that
// waits on a claim held elsewhere ends because its ClaimTimeout expires, or because its
// consumer shuts down (the message context is cancelled). pgx breaks the connection when a
// context ends mid-query; the count made before the claim must still be taken back ("failed
// to claim ... ClaimTimeout: no"), so the message is processed once released, never
// dead-lettered, and no attempt row or lock is left.
func TestClaimCancelledWhileWaitingDoesNotCount(t *testing.T) {
	for _, how := range []string{"claim-timeout", "shutdown"} {
		t.Run(how, func(t *testing.T) {
			e := newEnv(t, 4)
			dl := newDeadLetters(t)
			ib := e.inbox("billing", withDeadLetters(dl, 2), func(c *inbox.Config) { c.ClaimTimeout = 200 * time.Millisecond })
			if how == "shutdown" {
				ib = e.inbox("billing", withDeadLetters(dl, 2))
			}
			h := ib.Middleware(e.credit)
			if err := deliver(h, paymentMsg("m-warm", 2, 1)); err != nil {
				t.Fatal(err)
			}
			msg := paymentMsg("m-claim-cancelled", 1, 42)
			release := holdClaim(t, e, msg.UUID)
			for i := range 4 {
				m := msg.Copy()
				ctx, cancel := context.WithCancel(context.Background())
				if how == "shutdown" {
					time.AfterFunc(200*time.Millisecond, cancel)
				}
				m.SetContext(ctx)
				_, err := h(m)
				cancel()
				if err == nil {
					t.Fatalf("delivery %d acked while the claim was held elsewhere", i+1)
				}
				if att, _, _ := e.attemptsRow(msg.UUID); att != 0 {
					t.Errorf("after failed claim %d: attempts %d, want 0 (the handler never ran)", i+1, att)
				}
			}
			release()
			if err := deliver(h, msg); err != nil {
				t.Fatalf("after the claim was released: %v", err)
			}
			if b := e.balance(1); b != 42 {
				t.Fatalf("balance %d, want 42; stats %+v", b, ib.Stats())
			}
			if s := ib.Stats(); s.DeadLettered != 0 {
				t.Fatalf("stats %+v: a message that never reached its handler was dead-lettered", s)
			}
			if r := e.attemptRows(); r != 0 {
				t.Fatalf("%d attempt rows left", r)
			}
			if l := e.advisoryLocks(msg.UUID); l != 0 {
				t.Fatalf("%d advisory locks left", l)
			}
		})
	}
}

// TestTimeoutMiddlewareDeadlineCounts: Watermill's Timeout outside the inbox; the handler's
// query outlives it (pgx breaks the connection when the deadline ends the query). A deadline
// is the message's failure (context.DeadlineExceeded, not the shutdown's context.Canceled):
// the message is dead-lettered after exactly MaxAttempts runs, nothing is applied, and no
// lock or connection is left behind.
func TestTimeoutMiddlewareDeadlineCounts(t *testing.T) {
	const maxAttempts = 3
	for _, sig := range signals {
		t.Run(sig.name, func(t *testing.T) {
			e := newEnv(t, 4)
			dl := newDeadLetters(t)
			ib := e.inbox("billing", withDeadLetters(dl, maxAttempts), sig.mod)
			slow := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				if _, err := e.credit(msg); err != nil {
					return nil, err
				}
				tx, _ := pgstore.TxFromContext(msg.Context())
				_, err := tx.Exec(msg.Context(), "SELECT pg_sleep(5)")
				return nil, err
			})
			h := wmmiddleware.Timeout(150 * time.Millisecond)(slow)
			msg := paymentMsg("m-too-slow", 8, 3)
			n := redeliverUntilAcked(t, h, msg, 2*maxAttempts)
			if runs := e.runs.Load(); runs != maxAttempts || n != maxAttempts {
				t.Fatalf("handler runs %d, deliveries %d; want %d each: every deadline counts once", runs, n, maxAttempts)
			}
			r := dl.wait(t, 1)[0].Metadata.Get(wmmiddleware.ReasonForPoisonedKey)
			if !strings.Contains(r, fmt.Sprintf("failed %d of %d attempts", maxAttempts, maxAttempts)) {
				t.Fatalf("reason %q", r)
			}
			if b, rows := e.balance(8), e.rows(""); b != 0 || rows != 0 {
				t.Fatalf("balance %d, rows %d; want 0, 0", b, rows)
			}
			if _, _, dead := e.attemptsRow(msg.UUID); !dead {
				t.Fatal("not marked dead-lettered")
			}
			if l := e.advisoryLocks(msg.UUID); l != 0 {
				t.Fatalf("%d advisory locks left", l)
			}
		})
	}
}

// TestPanicUnderRetryCountsOnce: a handler that always panics, behind Watermill's Recoverer
// and Retry in both orders. Each run that panicked is one attempt: dead-lettered after exactly
// MaxAttempts runs, the panic then swallowed (acked); no lock left on a pooled connection.
func TestPanicUnderRetryCountsOnce(t *testing.T) {
	const maxAttempts = 3
	orders := map[string]func(h message.HandlerFunc) message.HandlerFunc{
		"retry-outside-recoverer": func(h message.HandlerFunc) message.HandlerFunc {
			return wmmiddleware.Retry{MaxRetries: 10, InitialInterval: time.Millisecond}.Middleware(wmmiddleware.Recoverer(h))
		},
		"recoverer-outside-retry": func(h message.HandlerFunc) message.HandlerFunc {
			return wmmiddleware.Recoverer(wmmiddleware.Retry{MaxRetries: 10, InitialInterval: time.Millisecond}.Middleware(h))
		},
	}
	for name, wrap := range orders {
		for _, sig := range signals {
			t.Run(name+"/"+sig.name, func(t *testing.T) {
				e := newEnv(t, 2)
				dl := newDeadLetters(t)
				ib := e.inbox("billing", withDeadLetters(dl, maxAttempts), sig.mod)
				h := wrap(ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					if _, err := e.credit(msg); err != nil {
						return nil, err
					}
					panic("poison")
				}))
				msg := paymentMsg("m-panic-retry", 9, 4)
				redeliverUntilAcked(t, h, msg, 2*maxAttempts)
				if runs := e.runs.Load(); runs != maxAttempts {
					t.Fatalf("handler runs %d, want %d", runs, maxAttempts)
				}
				dl.wait(t, 1)
				if b, rows := e.balance(9), e.rows(""); b != 0 || rows != 0 {
					t.Fatalf("balance %d, rows %d", b, rows)
				}
				if att, _, dead := e.attemptsRow(msg.UUID); !dead || att != maxAttempts {
					t.Fatalf("attempt row (%d, dead=%v), want (%d, true)", att, dead, maxAttempts)
				}
				if l := e.advisoryLocks(msg.UUID); l != 0 {
					t.Fatalf("%d advisory locks left", l)
				}
			})
		}
	}
}

// TestDeadLetteredKeyResentAsFirstDelivery: a dead-lettered message sent again as a first
// delivery (a producer's resend, not flagged redelivered) or as a redelivery, at each
// isolation level: every claim reads the key's attempt record, so each copy is skipped and
// acked without running the handler, no second dead letter is published and the record is
// unchanged, until Replay; the copy delivered after Replay is applied once.
func TestDeadLetteredKeyResentAsFirstDelivery(t *testing.T) {
	for _, iso := range []sql.IsolationLevel{sql.LevelReadCommitted, sql.LevelRepeatableRead, sql.LevelSerializable} {
		t.Run(iso.String(), func(t *testing.T) {
			e := newEnv(t, 3)
			dl := newDeadLetters(t)
			ib := e.inbox("billing", withDeadLetters(dl, 5), func(c *inbox.Config) {
				c.Redelivery = redeliveryFromFlag
				c.Isolation = iso
			})
			var healthy atomic.Bool
			h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				if _, err := e.credit(msg); err != nil {
					return nil, err
				}
				if !healthy.Load() {
					return nil, inbox.Permanent(errors.New("malformed"))
				}
				return nil, nil
			})
			msg := paymentMsg("m-dead-resent", 5, 6)
			if err := deliver(h, msg); err != nil {
				t.Fatal(err)
			}
			dl.wait(t, 1)
			attempts, _, _ := e.attemptsRow(msg.UUID)
			redelivered := msg.Copy()
			redelivered.Metadata.Set(redeliveredKey, "true")
			healthy.Store(true)
			for range 3 {
				for _, m := range []*message.Message{msg, redelivered} {
					if err := deliver(h, m); err != nil {
						t.Fatalf("a copy of a dead-lettered message: %v, want it skipped and acked", err)
					}
				}
			}
			time.Sleep(50 * time.Millisecond) // a second dead letter would be in by now
			dl.wait(t, 1)
			if r, s := e.runs.Load(), ib.Stats(); r != 1 || s.DeadLetteredSkips != 6 || s.DeadLettered != 1 {
				t.Fatalf("handler runs %d, stats %+v; want 1 run, 6 dead-lettered skips, 1 dead letter", r, s)
			}
			if n, _, dead := e.attemptsRow(msg.UUID); !dead || n != attempts || e.rows("") != 0 || e.balance(5) != 0 {
				t.Fatalf("attempts %d (was %d), dead-lettered %v, inbox rows %d, balance %d: the record changed or the message was applied",
					n, attempts, dead, e.rows(""), e.balance(5))
			}
			if ok, err := ib.Replay(context.Background(), msg.UUID); err != nil || !ok {
				t.Fatalf("Replay = %v, %v; want true", ok, err)
			}
			for range 2 {
				if err := deliver(h, msg); err != nil {
					t.Fatal(err)
				}
			}
			if b, r, s := e.balance(5), e.attemptRows(), ib.Stats(); b != 6 || r != 0 || s.Duplicates != 1 || s.Processed != 1 {
				t.Fatalf("after replay: balance %d, attempt rows %d, stats %+v; want 6, 0, one processed and one duplicate", b, r, s)
			}
		})
	}
}

// TestFailOnAnExhaustedPool: the pool has exactly as many connections as deliveries in
// flight (1, then 6), every delivery fails at the same moment, so Fail finds no second
// connection and takes its fallback (roll back, then record). Each failure must still count
// exactly once, every message must then be processed once, and no attempt row, lock or
// acquired connection may be left.
func TestFailOnAnExhaustedPool(t *testing.T) {
	for _, conns := range []int32{1, 6} {
		for _, sig := range signals {
			t.Run(fmt.Sprintf("conns=%d/%s", conns, sig.name), func(t *testing.T) {
				e := newEnv(t, conns)
				dl := newDeadLetters(t)
				ib := e.inbox("billing", withDeadLetters(dl, 3), sig.mod)
				var failing atomic.Bool
				failing.Store(true)
				var arrived atomic.Int32
				gate := make(chan struct{})
				h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					if _, err := e.credit(msg); err != nil {
						return nil, err
					}
					if failing.Load() {
						if arrived.Add(1) == conns {
							close(gate)
						}
						<-gate // every connection is held by a running handler
						return nil, errors.New("transient")
					}
					return nil, nil
				})
				ids := make([]string, conns)
				errs := make(chan error, conns)
				for i := range ids {
					ids[i] = fmt.Sprintf("m-exhausted-%d", i)
					go func() { errs <- deliver(h, paymentMsg(ids[i], i+1, 1)) }() // one account each: no row lock between them
				}
				for range ids {
					if err := <-errs; err == nil {
						t.Fatal("a failing delivery was acked")
					}
				}
				for _, id := range ids {
					if att, lastErr, _ := e.attemptsRow(id); att != 1 || lastErr != "transient" {
						t.Fatalf("%s: attempt row (%d, %q), want (1, transient)", id, att, lastErr)
					}
				}
				failing.Store(false)
				for i, id := range ids {
					m := paymentMsg(id, i+1, 1)
					m.Metadata.Set(redeliveredKey, "true")
					if err := deliver(h, m); err != nil {
						t.Fatal(err)
					}
				}
				if b, r, a := int64(e.count("SELECT sum(balance)::int FROM accounts")), e.rows(""), e.attemptRows(); b != int64(conns) || r != int(conns) || a != 0 {
					t.Fatalf("balance %d, rows %d, attempt rows %d; want %d, %d, 0", b, r, a, conns, conns)
				}
				if l := e.advisoryLocks(ids...); l != 0 {
					t.Fatalf("%d advisory locks left", l)
				}
				dl.wait(t, 0)
			})
		}
	}
}
