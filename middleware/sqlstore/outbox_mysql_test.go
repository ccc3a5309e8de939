package sqlstore_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/go-sql-driver/mysql"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/sqlstore"
)

// gatedStore holds each claim's Commit until release is closed, after telling atCommit: the
// outbox rows are inserted in the inbox transaction and not committed yet.
type gatedStore struct {
	*sqlstore.Store
	atCommit chan string
	release  chan struct{}
}

type gatedTx struct {
	contract.Tx
	s  *gatedStore
	id string
}

func (s *gatedStore) Claim(ctx context.Context, d contract.Delivery) (contract.Tx, contract.Claim, error) {
	tx, c, err := s.Store.Claim(ctx, d)
	if tx == nil {
		return tx, c, err
	}
	return gatedTx{Tx: tx, s: s, id: d.Key.MessageID}, c, err
}

func (t gatedTx) Commit(ctx context.Context) error {
	t.s.atCommit <- t.id
	<-t.s.release
	return t.Tx.Commit(ctx)
}

// TestOutboxOnSQLStoreMySQL: on sqlstore's MySQL dialect the outbox writes watermill-sql's
// MySQL queue schema in the inbox's *sql.Tx, and the relay (RelayConfig.MySQL) publishes a
// produced message exactly when its transaction commits: not while the transaction is open,
// never after a rollback, and once after the commit, then deletes its row; a duplicate
// delivery produces nothing again.
func TestOutboxOnSQLStoreMySQL(t *testing.T) {
	b := newBank(t, sqlstore.MySQL, 8)
	ctx := ctxT(t)
	ocfg := outbox.Config{Schema: b.schema}
	for range 2 { // the second call finds both tables and only reads
		if err := outbox.InitializeMySQLSchema(ctx, b.db, ocfg); err != nil {
			t.Fatal(err)
		}
	}
	ob, err := outbox.New(ocfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	gated := &gatedStore{Store: b.store, atCommit: make(chan string, 1), release: make(chan struct{})}
	ib := b.inbox(func(c *inbox.Config) { c.Store = gated; c.Outbox = ob })
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if err := b.credit(msg, 1, 100); err != nil {
			return nil, err
		}
		out := message.NewMessage("out-"+msg.UUID, []byte(`{"payment":"`+msg.UUID+`"}`))
		out.Metadata.Set("kind", "receipt")
		if msg.UUID == "pay-fail" {
			return []*message.Message{out}, errors.New("boom") // written, then rolled back
		}
		return []*message.Message{out}, nil
	})

	received, relay := startMySQLRelay(t, ocfg, b.db)

	outboxRows := func() int { return b.count(t, "SELECT count(*) FROM "+ocfg.MySQLMessagesTable()) }
	relayedAll := func(why string) { // a relayed row is deleted in the relay's transaction
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); outboxRows() != 0; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: %d outbox rows left", why, outboxRows())
			}
		}
	}
	deliverAsync := func(id string) chan error {
		done := make(chan error, 1)
		go func() {
			m := message.NewMessage(id, []byte(`{}`))
			m.SetContext(inbox.ContextWithPublishTopic(ctx, "ledger"))
			_, err := h(m)
			done <- err
		}()
		return done
	}
	expectNothing := func(d time.Duration, why string) {
		t.Helper()
		select {
		case m := <-received:
			t.Fatalf("%s: the relay published %s", why, m.UUID)
		case <-time.After(d):
		}
	}
	expect := func(id string) {
		t.Helper()
		select {
		case m := <-received:
			m.Ack()
			if m.UUID != id || string(m.Payload) != `{"payment":"`+id[len("out-"):]+`"}` || m.Metadata.Get("kind") != "receipt" {
				t.Fatalf("relayed %s %s %v, want %s with its payload and metadata", m.UUID, m.Payload, m.Metadata, id)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s was not relayed within 10 s", id)
		}
	}

	// 1. The transaction is open, its outbox row inserted: nothing is visible, nothing relayed.
	done := deliverAsync("pay-1")
	if id := <-gated.atCommit; id != "pay-1" {
		t.Fatalf("commit of %s, want pay-1", id)
	}
	expectNothing(500*time.Millisecond, "before the commit")
	if n := outboxRows(); n != 0 {
		t.Fatalf("%d committed outbox rows before the commit", n)
	}
	close(gated.release) // commits from now on proceed at once
	go func() {
		for range gated.atCommit {
		}
	}()
	if err := <-done; err != nil {
		t.Fatalf("pay-1: %v", err)
	}
	expect("out-pay-1")
	relayedAll("after pay-1")

	// 2. A failed delivery wrote its row and its balance, and rolled both back.
	if err := <-deliverAsync("pay-fail"); err == nil {
		t.Fatal("pay-fail: no error")
	}
	if n := outboxRows(); n != 0 {
		t.Fatalf("a rolled-back delivery left %d outbox rows", n)
	}
	// 3. A duplicate of pay-1 skips the handler: no row, no message.
	if err := <-deliverAsync("pay-1"); err != nil {
		t.Fatalf("pay-1 again: %v", err)
	}
	// 4. A later payment's message arrives; the rolled-back one never does.
	if err := <-deliverAsync("pay-2"); err != nil {
		t.Fatalf("pay-2: %v", err)
	}
	expect("out-pay-2")
	expectNothing(500*time.Millisecond, "after the last commit")

	relayedAll("after pay-2")
	if got, n := b.balance(1), processedRows(t, b.store); got != 200 || n != 2 {
		t.Fatalf("balance %d, %d inbox rows; want 200 and 2 (pay-1 and pay-2 once each)", got, n)
	}
	if st := relay.Stats(); st.Relayed != 2 {
		t.Fatalf("relay stats %+v, want 2 relayed", st)
	}
	lag, err := relay.Lag(ctx)
	if err != nil || lag.Pending != 0 || lag.OffsetGap != 0 {
		t.Fatalf("relay lag %+v (%v), want nothing pending", lag, err)
	}
}

// TestOutboxOnSQLStoreMySQLLeastPrivilegedUser: a MySQL user holding exactly sqlstore.GrantSQL's
// and outbox.MySQLGrantSQL's grants (and its own accounts table's) runs the inbox with the
// outbox and the relay: a delivery credits once and its produced message is relayed once, then
// its outbox row deleted; a duplicate produces nothing; the user cannot create the outbox
// table itself.
func TestOutboxOnSQLStoreMySQLLeastPrivilegedUser(t *testing.T) {
	b := newBank(t, sqlstore.MySQL, 4)
	ctx := ctxT(t)
	ocfg := outbox.Config{Schema: b.schema, Topic: "receipts"}
	if err := outbox.InitializeMySQLSchema(ctx, b.db, ocfg); err != nil {
		t.Fatal(err)
	}
	user := randomName("wo_")
	b.exec(t, "CREATE USER '"+user+"'@'%'")
	t.Cleanup(func() { _, _ = b.db.Exec("DROP USER IF EXISTS '" + user + "'@'%'") })
	inboxGrants, err := sqlstore.GrantSQL(b.store.Config(), user)
	if err != nil {
		t.Fatal(err)
	}
	outboxGrants, err := outbox.MySQLGrantSQL(ocfg, user)
	if err != nil {
		t.Fatal(err)
	}
	script := inboxGrants + outboxGrants + "GRANT SELECT, UPDATE ON `" + b.schema + "`.accounts TO '" + user + "'@'%';\n"
	for _, stmt := range strings.Split(strings.TrimSpace(script), "\n") {
		if !strings.HasPrefix(stmt, "--") {
			b.exec(t, strings.TrimSuffix(stmt, ";"))
		}
	}
	dsn, err := mysql.ParseDSN(b.dsn)
	if err != nil {
		t.Fatal(err)
	}
	dsn.User, dsn.Passwd = user, ""
	app := (&env{dialect: sqlstore.MySQL, schema: b.schema}).open(t, dsn.FormatDSN(), 4)
	if err := outbox.InitializeMySQLSchema(ctx, app, outbox.Config{Schema: b.schema, Topic: "other"}); err == nil {
		t.Fatal("the user created an outbox table")
	}
	store, err := sqlstore.New(app, b.store.Config())
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(ocfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ib := b.inbox(func(c *inbox.Config) { c.Store = store; c.Outbox = ob })
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if err := b.credit(msg, 1, 100); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage("out-"+msg.UUID, []byte(`{}`))}, nil
	})
	received, _ := startMySQLRelay(t, ocfg, app)
	for range 2 { // the second delivery is a duplicate
		m := message.NewMessage("pay-1", []byte(`{}`))
		m.SetContext(inbox.ContextWithPublishTopic(ctx, "ledger"))
		if _, err := h(m); err != nil {
			t.Fatalf("delivery as the least-privileged user: %v", err)
		}
	}
	select {
	case m := <-received:
		m.Ack()
		if m.UUID != "out-pay-1" {
			t.Fatalf("relayed %s, want out-pay-1", m.UUID)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("out-pay-1 was not relayed within 10 s")
	}
	for deadline := time.Now().Add(5 * time.Second); b.count(t, "SELECT count(*) FROM "+ocfg.MySQLMessagesTable()) != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the relayed row was not deleted")
		}
	}
	select {
	case m := <-received:
		t.Fatalf("relayed %s again", m.UUID)
	case <-time.After(300 * time.Millisecond):
	}
	if got, n := b.balance(1), processedRows(t, b.store); got != 100 || n != 1 {
		t.Fatalf("balance %d, %d inbox rows; want 100 and 1", got, n)
	}
}

// TestMySQLGrantSQLRefusesBadNames: a user name that could break out of its quotes, an empty
// one and an invalid topic are refused before any statement is written.
func TestMySQLGrantSQLRefusesBadNames(t *testing.T) {
	for _, c := range []struct {
		cfg  outbox.Config
		user string
	}{
		{outbox.Config{}, "app'@'%"}, {outbox.Config{}, ""}, {outbox.Config{}, "a b"}, {outbox.Config{}, "a`b"},
		{outbox.Config{Topic: "a`b"}, "app"}, {outbox.Config{Schema: "x'y"}, "app"},
	} {
		if s, err := outbox.MySQLGrantSQL(c.cfg, c.user); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("MySQLGrantSQL(%+v, %q): %q, %v; want ErrInvalidConfig", c.cfg, c.user, s, err)
		}
	}
}

// startMySQLRelay runs a relay of ocfg on db (RelayConfig.MySQL) into a persistent GoChannel
// until t ends, and returns the channel of what it publishes on topic "ledger".
func startMySQLRelay(t *testing.T, ocfg outbox.Config, db *sql.DB) (<-chan *message.Message, *outbox.Relay) {
	t.Helper()
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 16}, nil)
	t.Cleanup(func() { _ = broker.Close() })
	received, err := broker.Subscribe(context.Background(), "ledger")
	if err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(outbox.RelayConfig{Config: ocfg, MySQL: db, Publisher: broker, PollInterval: 20 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(context.Background()) }()
	t.Cleanup(func() {
		_ = relay.Close()
		if err := <-relayDone; err != nil {
			t.Errorf("relay.Run: %v", err)
		}
	})
	<-relay.Running()
	return received, relay
}
