package inbox_test

import (
	"context"
	"database/sql"
	"errors"
	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

func TestSequentialDuplicateAppliesOnce(t *testing.T) {
	e := newEnv(t, 2)
	ib := e.inbox("billing")
	h := ib.Middleware(e.credit)
	msg := paymentMsg("3f6c2a9e-8b1d-4e7a-9c55-0d2f1b7e4a10", 1, 250)
	for i := range 3 {
		if err := deliver(h, msg); err != nil {
			t.Fatalf("delivery %d: %v (a duplicate must succeed so the router acks)", i+1, err)
		}
	}
	if b := e.balance(1); b != 250 {
		t.Fatalf("balance = %d after three deliveries of one payment, want 250", b)
	}
	if r := e.runs.Load(); r != 1 {
		t.Fatalf("handler ran %d times, want 1 (duplicates must skip it)", r)
	}
	if n := e.rows(""); n != 1 {
		t.Fatalf("inbox rows = %d, want 1", n)
	}
	if s := ib.Stats(); s.Processed != 1 || s.Duplicates != 2 || s.Failed != 0 {
		t.Fatalf("stats = %+v, want 1 processed, 2 duplicates", s)
	}
}

func TestConcurrentDuplicateOneCommits(t *testing.T) {
	const workers = 8
	e := newEnv(t, workers)
	bs := newBarrierStore(e.store, workers)
	ib, err := inbox.New(inbox.Config{Store: bs, ConsumerName: "billing"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		out, err := e.credit(msg)
		// Hold the claim open so the other workers are queued on the unique key.
		time.Sleep(200 * time.Millisecond)
		return out, err
	})
	msg := paymentMsg("order-42", 2, 1000)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Go(func() { errs <- deliver(h, msg) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("a concurrent duplicate returned %v; every worker must end acked (no 23505 may escape)", err)
		}
	}
	if b := e.balance(2); b != 1000 {
		t.Fatalf("balance = %d after %d concurrent deliveries, want 1000", b, workers)
	}
	if r := e.runs.Load(); r != 1 {
		t.Fatalf("handler ran %d times, want exactly 1", r)
	}
	if s := ib.Stats(); s.Processed != 1 || s.Duplicates != workers-1 {
		t.Fatalf("stats = %+v, want 1 processed and %d duplicates", s, workers-1)
	}
}

func TestFailedAttemptLeavesNoMark(t *testing.T) {
	e := newEnv(t, 2)
	ib := e.inbox("billing")
	fail := true
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := e.credit(msg); err != nil {
			return nil, err
		}
		if fail {
			return nil, errors.New("downstream unavailable")
		}
		return nil, nil
	})
	msg := paymentMsg("m-fail-once", 3, 70)
	if err := deliver(h, msg); err == nil || !strings.Contains(err.Error(), "downstream unavailable") {
		t.Fatalf("first delivery error = %v, want the handler's error (nack)", err)
	}
	if b, n := e.balance(3), e.rows(""); b != 0 || n != 0 {
		t.Fatalf("after a failed attempt: balance %d, inbox rows %d; want 0 and 0", b, n)
	}
	fail = false
	if err := deliver(h, msg); err != nil {
		t.Fatalf("redelivery: %v", err)
	}
	if b, n := e.balance(3), e.rows(""); b != 70 || n != 1 {
		t.Fatalf("after redelivery: balance %d, rows %d; want 70 and 1 (the failed attempt must not look processed)", b, n)
	}
}

func TestHandlerPanicRollsBack(t *testing.T) {
	e := newEnv(t, 2)
	ib := e.inbox("billing")
	panicking := true
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := e.credit(msg); err != nil {
			return nil, err
		}
		if panicking {
			panic("handler bug")
		}
		return nil, nil
	})
	msg := paymentMsg("m-panic", 4, 5)
	func() {
		defer func() {
			if r := recover(); r != "handler bug" {
				t.Fatalf("recovered %v, want the handler's panic to propagate to the router", r)
			}
		}()
		_ = deliver(h, msg)
	}()
	if b, n := e.balance(4), e.rows(""); b != 0 || n != 0 {
		t.Fatalf("after a panic: balance %d, rows %d; want 0 and 0", b, n)
	}
	panicking = false
	if err := deliver(h, msg); err != nil {
		t.Fatal(err)
	}
	if b := e.balance(4); b != 5 {
		t.Fatalf("balance = %d, want 5", b)
	}
}

func TestSwallowedStatementErrorFailsCommit(t *testing.T) {
	e := newEnv(t, 2)
	ib := e.inbox("billing")
	swallow := true
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := e.credit(msg); err != nil {
			return nil, err
		}
		if swallow {
			tx, _ := pgstore.TxFromContext(msg.Context())
			// The handler ignores this failure; PostgreSQL has aborted the transaction
			// (25P02 for later statements) and COMMIT will answer ROLLBACK.
			_, _ = tx.Exec(msg.Context(), "INSERT INTO accounts (id, balance) VALUES (1, 0)")
		}
		return nil, nil
	})
	msg := paymentMsg("m-swallow", 5, 33)
	err := deliver(h, msg)
	if !errors.Is(err, pgx.ErrTxCommitRollback) {
		t.Fatalf("delivery error = %v, want pgx.ErrTxCommitRollback (never ack a rolled-back commit)", err)
	}
	if b, n := e.balance(5), e.rows(""); b != 0 || n != 0 {
		t.Fatalf("after a commit that rolled back: balance %d, rows %d; want 0 and 0", b, n)
	}
	swallow = false
	if err := deliver(h, msg); err != nil {
		t.Fatal(err)
	}
	if b, n := e.balance(5), e.rows(""); b != 33 || n != 1 {
		t.Fatalf("after redelivery: balance %d, rows %d; want 33 and 1", b, n)
	}
}

func TestCommitCancelledEndsProcessedOnce(t *testing.T) {
	e := newEnv(t, 3)
	// A deferred constraint trigger makes COMMIT itself slow, so FinishTimeout expires during
	// COMMIT. pgx then cancels the statement on the server, so the outcome is decided by a
	// race the test does not control: either way the delivery is nacked and the redelivery
	// ends with one effect.
	e.exec(`CREATE TABLE slow_commit (id int);
		CREATE FUNCTION slow_commit_fn() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.6); RETURN NULL; END $$;
		CREATE CONSTRAINT TRIGGER slow_commit_trg AFTER INSERT ON slow_commit DEFERRABLE INITIALLY DEFERRED
			FOR EACH ROW EXECUTE FUNCTION slow_commit_fn();`)
	ib := e.inbox("billing", func(c *inbox.Config) { c.FinishTimeout = 150 * time.Millisecond })
	slow := true
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := e.credit(msg); err != nil {
			return nil, err
		}
		if slow {
			tx, _ := pgstore.TxFromContext(msg.Context())
			if _, err := tx.Exec(msg.Context(), "INSERT INTO slow_commit VALUES (1)"); err != nil {
				return nil, err
			}
		}
		return nil, nil
	})
	msg := paymentMsg("m-commit-timeout", 6, 400)
	if err := deliver(h, msg); err == nil {
		t.Fatal("a commit that timed out returned success; it must nack")
	}
	slow = false
	if err := deliver(h, msg); err != nil {
		t.Fatalf("redelivery: %v", err)
	}
	if b, n := e.balance(6), e.rows(""); b != 400 || n != 1 {
		t.Fatalf("balance %d, rows %d; want 400 and 1", b, n)
	}
}

func TestCommitResponseLostThenRedeliveryIsDuplicate(t *testing.T) {
	e := newEnv(t, 1)
	// The inbox talks to PostgreSQL through a proxy that swallows the answer to COMMIT: the
	// server commits, the client sees a timeout (outcome unknown).
	proxy := testenv.NewProxy(t, testenv.DatabaseHostPort(t))
	pool := testenv.NewPool(t, testenv.WithHost(t, e.sch.URL, proxy.Addr), 1)
	store, err := pgstore.New(pool, pgstore.Config{Schema: e.sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	ib := e.inbox("billing", func(c *inbox.Config) { c.Store = store; c.FinishTimeout = 300 * time.Millisecond })
	lose := true
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		out, err := e.credit(msg)
		if lose {
			proxy.Hold() // every later answer on this connection is lost, COMMIT's included
		}
		return out, err
	})
	// A first message on the one connection: its statements are prepared, so the lost answer
	// below is COMMIT's, not a prepare's.
	lose = false
	if err := deliver(h, paymentMsg("m-warm", 7, 1)); err != nil {
		t.Fatal(err)
	}
	lose = true
	e.runs.Store(0)
	msg := paymentMsg("m-commit-lost", 6, 400)
	if err := deliver(h, msg); err == nil {
		t.Fatal("a commit whose answer never arrived returned success; it must nack")
	}
	lose = false
	if err := deliver(h, msg); err != nil {
		t.Fatalf("redelivery: %v", err)
	}
	if b, n := e.balance(6), e.rows("message_id = $1", msg.UUID); b != 400 || n != 1 {
		t.Fatalf("balance %d, rows %d; want 400 and 1", b, n)
	}
	if s := ib.Stats(); s.Duplicates != 1 || e.runs.Load() != 1 {
		t.Fatalf("stats %+v, handler runs %d; want the redelivery resolved as a duplicate without running the handler", s, e.runs.Load())
	}
	if b := e.balance(7); b != 1 {
		t.Fatalf("warm-up balance %d, want 1", b)
	}
}

func TestMessageContextCancelledAfterHandlerStillCommits(t *testing.T) {
	e := newEnv(t, 2)
	ib := e.inbox("billing")
	var cancel context.CancelFunc
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		out, err := e.credit(msg)
		cancel() // the router shuts down right after the handler's writes
		return out, err
	})
	msg := paymentMsg("m-shutdown", 7, 12)
	ctx, c := context.WithCancel(context.Background())
	cancel = c
	msg.SetContext(ctx)
	if _, err := h(msg); err != nil {
		t.Fatalf("commit after the message context was cancelled: %v (commit must use a detached context)", err)
	}
	if b, n := e.balance(7), e.rows(""); b != 12 || n != 1 {
		t.Fatalf("balance %d, rows %d; want 12 and 1", b, n)
	}
}

// serializationPair runs two deliveries that update the same account at the same time under
// iso, so the second hits SQLSTATE 40001 when the first commits.
func serializationPair(t *testing.T, iso sql.IsolationLevel, maxRetries int) (*env, *inbox.Inbox, []error) {
	e := newEnv(t, 3)
	ib := e.inbox("billing", func(c *inbox.Config) { c.Isolation = iso; c.MaxTxRetries = maxRetries })
	firstIn, secondIn := make(chan struct{}), make(chan struct{})
	var once, onceSecond sync.Once
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := pgstore.TxFromContext(msg.Context())
		var bal int64 // take the snapshot before the other transaction commits
		if err := tx.QueryRow(msg.Context(), "SELECT balance FROM accounts WHERE id = 8").Scan(&bal); err != nil {
			return nil, err
		}
		if msg.UUID == "m-ser-1" {
			if _, err := e.credit(msg); err != nil {
				return nil, err
			}
			once.Do(func() { close(firstIn) })
			// Commit only once the second delivery holds its snapshot, however slow the
			// machine is to start it: that is what makes its update conflict (40001).
			select {
			case <-secondIn:
			case <-time.After(30 * time.Second):
			}
			time.Sleep(50 * time.Millisecond)
			return nil, nil
		}
		onceSecond.Do(func() { close(secondIn) })
		<-firstIn
		return e.credit(msg)
	})
	var wg sync.WaitGroup
	errs := make([]error, 2)
	wg.Go(func() { errs[0] = deliver(h, paymentMsg("m-ser-1", 8, 100)) })
	wg.Go(func() { errs[1] = deliver(h, paymentMsg("m-ser-2", 8, 10)) })
	wg.Wait()
	return e, ib, errs
}

func TestSerializationFailureIsRetried(t *testing.T) {
	for _, iso := range []sql.IsolationLevel{sql.LevelRepeatableRead, sql.LevelSerializable} {
		t.Run(iso.String(), func(t *testing.T) {
			e, ib, errs := serializationPair(t, iso, 0)
			if errs[0] != nil || errs[1] != nil {
				t.Fatalf("errors %v; want both deliveries processed after the retry", errs)
			}
			if b, n := e.balance(8), e.rows(""); b != 110 || n != 2 {
				t.Fatalf("balance %d, rows %d; want 110 and 2 (each payment once)", b, n)
			}
			if s := ib.Stats(); s.TxRetries < 1 {
				t.Fatalf("stats %+v: no transaction retry recorded; the test did not provoke 40001", s)
			}
		})
	}
}

func TestSerializationFailureBeyondRetriesNacks(t *testing.T) {
	e, ib, errs := serializationPair(t, sql.LevelRepeatableRead, -1)
	if errs[0] != nil || errs[1] == nil || e.store.Classify(errs[1]) != contract.Retryable {
		t.Fatalf("errors %v; want the second delivery to fail with a retryable 40001 when retries are off", errs)
	}
	if b, n := e.balance(8), e.rows(""); b != 100 || n != 1 {
		t.Fatalf("balance %d, rows %d; want only the first payment (100) and its row", b, n)
	}
	if ib.Stats().Failed != 1 {
		t.Fatalf("stats %+v", ib.Stats())
	}
}

func TestTwoConsumersEachProcessOnce(t *testing.T) {
	e := newEnv(t, 3)
	e.exec("CREATE TABLE notifications (message_id text, consumer text)")
	billing := e.inbox("billing").Middleware(e.credit)
	notify := e.inbox("notifications").Middleware(func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := pgstore.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "INSERT INTO notifications VALUES ($1, 'notifications')", msg.UUID)
		return nil, err
	})
	msg := paymentMsg("order-placed-1", 9, 77)
	for range 2 {
		if err := deliver(billing, msg); err != nil {
			t.Fatal(err)
		}
		if err := deliver(notify, msg); err != nil {
			t.Fatal(err)
		}
	}
	var notes int
	_ = e.sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM notifications").Scan(&notes)
	if b := e.balance(9); b != 77 || notes != 1 {
		t.Fatalf("balance %d, notifications %d; want 77 and 1", b, notes)
	}
	if n := e.rows("message_id = $1", msg.UUID); n != 2 {
		t.Fatalf("inbox rows for the message = %d, want one per consumer (2)", n)
	}
}

func TestInvalidKeysAreRefused(t *testing.T) {
	// Every delivery here has an invalid key on purpose: the flood brake is off.
	e := newEnv(t, 2)
	ib := e.inbox("billing", func(c *inbox.Config) { c.InvalidKeyBrake.Disabled = true })
	h := ib.Middleware(e.credit)
	cases := map[string]string{
		"empty":        "",
		"blank":        "  \t",
		"10 KB":        strings.Repeat("k", 10*1024),
		"invalid UTF8": "id-\xff\xfe",
		"NUL":          "id\x00tail",
	}
	for name, id := range cases {
		t.Run(name, func(t *testing.T) {
			err := deliver(h, paymentMsg(id, 10, 1))
			var ike *inbox.InvalidKeyError
			if !errors.As(err, &ike) || !errors.Is(err, inbox.ErrInvalidKey) || !inbox.IsPermanent(err) {
				t.Fatalf("err = %v, want a permanent *InvalidKeyError", err)
			}
			if strings.Contains(err.Error(), "\xff") || len(err.Error()) > 200 {
				t.Fatalf("error string carries the raw key: %q", err.Error())
			}
		})
	}
	if b, n, r := e.balance(10), e.rows(""), e.runs.Load(); b != 0 || n != 0 || r != 0 {
		t.Fatalf("balance %d, rows %d, handler runs %d; want all 0", b, n, r)
	}
	if s := ib.Stats(); s.InvalidKeys != uint64(len(cases)) {
		t.Fatalf("stats %+v", s)
	}
}

func TestMetadataKeyExtractor(t *testing.T) {
	for _, field := range []string{"_watermill_amqp_redelivered", "x-delivery-count", "X-Death", "ApproximateReceiveCount", "offset", "partition"} {
		if _, err := inbox.MetadataKey(field); !errors.Is(err, inbox.ErrBrokerSideKey) {
			t.Errorf("MetadataKey(%q) = %v, want ErrBrokerSideKey", field, err)
		}
	}
	if _, err := inbox.MetadataKey(" "); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("MetadataKey(blank) = %v", err)
	}
	e := newEnv(t, 2)
	key, err := inbox.MetadataKey("idempotency_key")
	if err != nil {
		t.Fatal(err)
	}
	h := e.inbox("billing", func(c *inbox.Config) { c.KeyExtractor = key }).Middleware(e.credit)
	// A producer retry through a marshaler that mints a new UUID per publish: the business
	// key is the same, so the effect happens once.
	for _, uuid := range []string{"uuid-a", "uuid-b"} {
		m := paymentMsg(uuid, 1, 900)
		m.Metadata.Set("idempotency_key", "payment-request-77")
		if err := deliver(h, m); err != nil {
			t.Fatal(err)
		}
	}
	noKey := paymentMsg("uuid-c", 1, 5)
	if err := deliver(h, noKey); !errors.Is(err, inbox.ErrInvalidKey) {
		t.Fatalf("message without the key field: err = %v, want ErrInvalidKey (never processed unprotected)", err)
	}
	if b, n := e.balance(1), e.rows("message_id = 'payment-request-77'"); b != 900 || n != 1 {
		t.Fatalf("balance %d, rows %d; want 900 and 1", b, n)
	}
}

func TestProducedMessagesAreRefused(t *testing.T) {
	e := newEnv(t, 2)
	h := e.inbox("billing").Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if _, err := e.credit(msg); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage("out-1", nil)}, nil
	})
	if err := deliver(h, paymentMsg("m-produces", 2, 50)); !errors.Is(err, inbox.ErrProducedMessages) {
		t.Fatalf("err = %v, want ErrProducedMessages", err)
	}
	if b, n := e.balance(2), e.rows(""); b != 0 || n != 0 {
		t.Fatalf("balance %d, rows %d; nothing may be committed", b, n)
	}
}

func TestMetadataColumnsFilled(t *testing.T) {
	e := newEnv(t, 2)
	h := e.inbox("billing").Middleware(e.credit)
	msg := paymentMsg("m-cols", 3, 1)
	msg.Metadata.Set("name", "PaymentReceived")
	msg.Metadata.Set("correlation_id", "corr-123")
	if err := deliver(h, msg); err != nil {
		t.Fatal(err)
	}
	var typ, corr string
	var hash []byte
	if err := e.sch.Pool.QueryRow(context.Background(),
		"SELECT message_type, correlation_id, payload_hash FROM inbox_processed_messages WHERE message_id = 'm-cols'").Scan(&typ, &corr, &hash); err != nil {
		t.Fatal(err)
	}
	if typ != "PaymentReceived" || corr != "corr-123" || len(hash) != 32 {
		t.Fatalf("row: type %q, correlation %q, hash %d bytes", typ, corr, len(hash))
	}
}

func TestConfigValidation(t *testing.T) {
	e := newEnv(t, 1)
	for name, cfg := range map[string]inbox.Config{
		"no store":        {ConsumerName: "c"},
		"no consumer":     {Store: e.store},
		"blank consumer":  {Store: e.store, ConsumerName: "  "},
		"NUL consumer":    {Store: e.store, ConsumerName: "a\x00b"},
		"long consumer":   {Store: e.store, ConsumerName: strings.Repeat("c", inbox.MaxConsumerNameBytes+1)},
		"bad isolation":   {Store: e.store, ConsumerName: "c", Isolation: sql.LevelSnapshot},
		"negative finish": {Store: e.store, ConsumerName: "c", FinishTimeout: -time.Second},
	} {
		if _, err := inbox.New(cfg, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("%s: err = %v, want ErrInvalidConfig", name, err)
		}
	}
}
