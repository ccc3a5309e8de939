package deferred_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// newInbox returns a migrated store-then-process inbox in a fresh schema with cfg's settings
// (Pool, Schema filled in) and the schema's accounts 1..accounts.
func newInbox(t testing.TB, cfg deferred.Config, accounts int) (*deferred.Inbox, *testenv.Schema) {
	t.Helper()
	s := testenv.NewSchema(t, 10)
	if accounts > 0 {
		s.CreateAccounts(t, accounts)
	}
	ib := inboxOn(t, s.Pool, s.Name, cfg)
	return ib, s
}

func inboxOn(t testing.TB, pool *pgxpool.Pool, schema string, cfg deferred.Config) *deferred.Inbox {
	t.Helper()
	cfg.Pool, cfg.Schema = pool, schema
	if cfg.ConsumerName == "" {
		cfg.ConsumerName = "billing"
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 200 * time.Millisecond
	}
	ib, err := deferred.New(cfg, testLogger)
	if err != nil {
		t.Fatalf("deferred.New: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if _, err := ib.Migrate(ctx); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	return ib
}

// payment returns a message crediting amount cents to account, with the aggregate key the
// account and seq its producer sequence when seq > 0.
func payment(id string, account, amount, seq int) *message.Message {
	m := message.NewMessage(id, []byte(fmt.Sprintf(`{"account":%d,"amount":%d}`, account, amount)))
	m.Metadata.Set("aggregate_id", strconv.Itoa(account))
	if seq > 0 {
		m.Metadata.Set("seq", strconv.Itoa(seq))
	}
	return m
}

// credit is the business handler of the tests: it credits the payment in the row's
// transaction, the same handler the immediate inbox runs.
func credit(msg *message.Message) error {
	tx, ok := pgstore.TxFromContext(msg.Context())
	if !ok {
		return fmt.Errorf("no transaction in the context")
	}
	var p struct{ Account, Amount int }
	if err := jsonUnmarshal(msg.Payload, &p); err != nil {
		return err
	}
	_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + $1 WHERE id = $2", p.Amount, p.Account)
	return err
}

// runWorkers starts w and stops it when t ends.
func runWorkers(t testing.TB, w *deferred.Workers) {
	t.Helper()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := w.Run(context.Background()); err != nil {
			t.Errorf("workers: %v", err)
		}
	}()
	<-w.Running()
	t.Cleanup(func() { _ = w.Close(); wg.Wait() })
}

// count returns a single integer from q.
func count(t testing.TB, pool *pgxpool.Pool, q string, args ...any) int64 {
	t.Helper()
	var n int64
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := pool.QueryRow(ctx, q, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	return n
}

// waitFor polls cond every 20 ms until it holds, failing t after timeout.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func newSchemaOnly(t testing.TB, conns int32) *testenv.Schema { return testenv.NewSchema(t, conns) }

// testLogger writes errors (and, with DEFERRED_TEST_VERBOSE=1, info) to stderr.
var testLogger = watermill.NewStdLoggerWithOut(os.Stderr, os.Getenv("DEFERRED_TEST_VERBOSE") == "1", false)
