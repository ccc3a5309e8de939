package inbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// env is one test's database: a fresh schema with the inbox table and an accounts table.
type env struct {
	t     *testing.T
	sch   *testenv.Schema
	store *pgstore.Store
	runs  atomic.Int64 // handler invocations

	// A layout env (newLayoutEnv) maps message names to UUIDv7 keys at the time at; names
	// records the mapping (nil in the text layout: keys are the names).
	at    time.Time
	mu    sync.Mutex
	names map[string]string
}

func newEnv(t *testing.T, conns int32) *env {
	t.Helper()
	sch := testenv.NewSchema(t, conns)
	store := sch.Store(t)
	sch.CreateAccounts(t, 10)
	t.Cleanup(func() {
		// Every delivery must give its connection back, whatever happened to it. A broken
		// connection counts as acquired until pgxpool has finished closing it, in the
		// background, so allow it a few seconds.
		deadline := time.Now().Add(5 * time.Second)
		for sch.Pool.Stat().AcquiredConns() != 0 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if n := sch.Pool.Stat().AcquiredConns(); n != 0 {
			t.Errorf("%d pool connections still acquired at the end of the test", n)
		}
	})
	return &env{t: t, sch: sch, store: store}
}

func (e *env) inbox(consumer string, mod ...func(*inbox.Config)) *inbox.Inbox {
	e.t.Helper()
	cfg := inbox.Config{Store: e.store, ConsumerName: consumer}
	if e.names != nil {
		cfg.KeyExtractor = layoutKeys{e}
	}
	for _, m := range mod {
		m(&cfg)
	}
	ib, err := inbox.New(cfg, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	return ib
}

// withLockTimeout gives the inbox a store on the same table with pgstore.Config.LockTimeout d.
func (e *env) withLockTimeout(d time.Duration) func(*inbox.Config) {
	return func(c *inbox.Config) {
		s, err := pgstore.New(e.sch.Pool, pgstore.Config{Schema: e.sch.Name, LockTimeout: d})
		if err != nil {
			e.t.Fatal(err)
		}
		c.Store = s
	}
}

type payment struct {
	Account int   `json:"account"`
	Amount  int64 `json:"amount"`
}

func paymentMsg(id string, account int, amount int64) *message.Message {
	b, _ := json.Marshal(payment{account, amount})
	return message.NewMessage(id, b)
}

// credit is the business handler: it adds the payment to the account in the inbox
// transaction and counts its runs.
func (e *env) credit(msg *message.Message) ([]*message.Message, error) {
	e.runs.Add(1)
	var p payment
	if err := json.Unmarshal(msg.Payload, &p); err != nil {
		return nil, inbox.Permanent(err)
	}
	tx, ok := pgstore.TxFromContext(msg.Context())
	if !ok {
		return nil, fmt.Errorf("no inbox transaction in the context")
	}
	_, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + $1 WHERE id = $2", p.Amount, p.Account)
	return nil, err
}

func (e *env) balance(account int) int64 {
	e.t.Helper()
	var b int64
	if err := e.sch.Pool.QueryRow(context.Background(), "SELECT balance FROM accounts WHERE id = $1", account).Scan(&b); err != nil {
		e.t.Fatal(err)
	}
	return b
}

// rows counts inbox rows, optionally for one message ID.
func (e *env) rows(where string, args ...any) int {
	e.t.Helper()
	var n int
	q := "SELECT count(*) FROM " + e.store.Table()
	if where != "" {
		q += " WHERE " + where
	}
	if err := e.sch.Pool.QueryRow(context.Background(), q, args...).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.sch.Pool.Exec(context.Background(), sql, args...); err != nil {
		e.t.Fatal(err)
	}
}

// deliver runs one delivery of msg through h as the router would, with a fresh context.
func deliver(h message.HandlerFunc, msg *message.Message) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m := msg.Copy()
	m.SetContext(ctx)
	_, err := h(m)
	return err
}

// barrierStore holds every claim until n callers have arrived, then releases them
// together: the concurrent-duplicate test's barrier just before the claim.
type barrierStore struct {
	contract.Store
	arrived chan struct{}
	release chan struct{}
	n       int
}

func newBarrierStore(s contract.Store, n int) *barrierStore {
	b := &barrierStore{Store: s, arrived: make(chan struct{}, n), release: make(chan struct{}), n: n}
	go func() {
		for range n {
			<-b.arrived
		}
		close(b.release)
	}()
	return b
}

func (b *barrierStore) Claim(ctx context.Context, d contract.Delivery) (contract.Tx, contract.Claim, error) {
	b.arrived <- struct{}{}
	<-b.release
	return b.Store.Claim(ctx, d)
}

// recordAttempt writes what a delivery of id that ran the handler without settling leaves in
// the attempts table: one more attempt, and errText as the last error (none: a crash).
func (e *env) recordAttempt(id, consumer, errText string) {
	e.t.Helper()
	var last any
	if errText != "" {
		last = errText
	}
	e.exec("INSERT INTO "+e.store.AttemptsTable()+" AS a (message_id, consumer_name, attempts, last_error) VALUES ($1, $2, 1, $3)"+
		" ON CONFLICT (message_id, consumer_name) DO UPDATE SET attempts = a.attempts + 1, last_error = coalesce(EXCLUDED.last_error, a.last_error)",
		id, consumer, last)
}
