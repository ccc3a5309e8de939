package router_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/adapters/postgres"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// syncBuffer is an io.Writer safe for concurrent log lines.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// tee sends every log line to two loggers.
type tee [2]watermill.LoggerAdapter

func (t tee) Error(msg string, err error, f watermill.LogFields) {
	t[0].Error(msg, err, f)
	t[1].Error(msg, err, f)
}
func (t tee) Info(msg string, f watermill.LogFields)  { t[0].Info(msg, f); t[1].Info(msg, f) }
func (t tee) Debug(msg string, f watermill.LogFields) { t[0].Debug(msg, f); t[1].Debug(msg, f) }
func (t tee) Trace(msg string, f watermill.LogFields) { t[0].Trace(msg, f); t[1].Trace(msg, f) }
func (t tee) With(f watermill.LogFields) watermill.LoggerAdapter {
	return tee{t[0].With(f), t[1].With(f)}
}

// TestNothingSecretOrForgedInTraceLogs runs the postgres broker (watermill-sql), the router,
// the inbox with a dead-letter topic, the outbox and its relay, all logging at trace level
// to Watermill's standard logger and to log/slog's text handler, through every path:
// processed, duplicate, key collision, poison message (dead-lettered), invalid key
// (dead-lettered) and the relay's publish. Payloads and metadata values carry a marker, and
// the idempotency keys and message UUIDs carry a forged log line. The marker never appears in
// the logs (watermill-sql's query_args, which carry payloads and metadata at trace level, are
// logged redacted) and no forged line does either.
func TestNothingSecretOrForgedInTraceLogs(t *testing.T) {
	const marker = "MARKER-7f3a9c"
	const forged = "\nlevel=ERROR msg=forged\r\x1b[2K"
	sch := testenv.NewSchema(t, 8)
	ctx := context.Background()
	store := sch.Store(t)
	sch.CreateAccounts(t, 2)
	obCfg := outbox.Config{Schema: sch.Name}
	if err := outbox.InitializeSchema(ctx, sch.Pool, obCfg); err != nil {
		t.Fatal(err)
	}
	var stdBuf, slogBuf syncBuffer
	logger := tee{
		watermill.NewStdLoggerWithOut(&stdBuf, true, true),
		watermill.NewSlogLogger(slog.New(slog.NewTextHandler(&slogBuf, &slog.HandlerOptions{Level: watermill.LevelTrace}))),
	}
	r, err := router.New(router.Config{Broker: postgres.Name, ConsumerGroupPrefix: sch.Name + "_",
		Settings: map[string]any{postgres.Name: &postgres.Config{PollInterval: 20 * time.Millisecond, ResendInterval: 20 * time.Millisecond}}}, sch.Pool, logger)
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(obCfg, logger)
	if err != nil {
		t.Fatal(err)
	}
	key, err := inbox.MetadataKey("idempotency_key")
	if err != nil {
		t.Fatal(err)
	}
	ib, err := r.NewInbox(inbox.Config{Store: store, ConsumerName: "billing", KeyExtractor: key, Outbox: ob,
		DeadLetterPublisher: r.Broker.Publisher, DeadLetterTopic: "billing_dead", MaxAttempts: 1,
		OnKeyCollision: inbox.CollisionDeadLetter}, logger)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.AddPublishingConsumer(ib, "payments", "receipts", func(msg *message.Message) ([]*message.Message, error) {
		var p struct {
			Amount int64  `json:"amount"`
			Note   string `json:"note"`
		}
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return nil, inbox.Permanent(err)
		}
		if p.Note == "poison" {
			return nil, errors.New("poison message")
		}
		tx, _ := pgstore.TxFromContext(msg.Context())
		if _, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + $1 WHERE id = 1", p.Amount); err != nil {
			return nil, err
		}
		// watermill-sql's uuid column is VARCHAR(36): "rcpt" and the forged line fit.
		receipt := message.NewMessage("rcpt"+forged, []byte(`{"receipt":"`+marker+`"}`))
		receipt.Metadata.Set("secret", marker)
		return []*message.Message{receipt}, nil
	}); err != nil {
		t.Fatal(err)
	}
	relay, err := outbox.NewRelay(outbox.RelayConfig{Config: obCfg, Pool: sch.Pool, Publisher: r.Broker.Publisher,
		ConsumerGroup: "relay", PollInterval: 20 * time.Millisecond}, logger)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = relay.Run(ctx) }()
	t.Cleanup(func() { _ = relay.Close() })
	go func() { _ = r.Run(ctx) }()
	<-r.Running()
	t.Cleanup(func() { _ = r.Close() })

	publish := func(uuid, k string, amount int64, note string) {
		t.Helper()
		m := message.NewMessage(uuid+forged, []byte(`{"amount":`+strings.TrimSpace(jsonInt(amount))+`,"note":"`+note+`","secret":"`+marker+`"}`))
		if k != "" {
			m.Metadata.Set("idempotency_key", k+forged)
		}
		m.Metadata.Set("card_number", marker)
		if err := r.Broker.Publisher.Publish("payments", m); err != nil {
			t.Fatal(err)
		}
	}
	publish("m-1", "k-1", 10, "ok")    // processed, relayed
	publish("m-2", "k-1", 10, "ok")    // duplicate (same key, same payload)
	publish("m-3", "k-1", 99, "ok")    // key collision: dead-lettered
	publish("m-4", "k-4", 5, "poison") // poison: dead-lettered (MaxAttempts 1)
	publish("m-5", "", 5, "no key")    // invalid key: dead-lettered
	count := func(sql string) int64 {
		var n int64
		if err := sch.Pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		return n
	}
	// The relay reads only rows older than every running transaction of the server
	// (watermill-sql's transaction_id < pg_snapshot_xmin), so a long transaction elsewhere on
	// a shared server delays it: allow it more time than the deliveries.
	deadline := time.Now().Add(30 * time.Second)
	relayDeadline := time.Now().Add(60 * time.Second)
	for {
		s := ib.Stats()
		relayed := count(`SELECT count(*) FROM pg_tables WHERE schemaname = '` + sch.Name + `' AND tablename = 'watermill_receipts'`)
		if relayed == 1 {
			relayed = count(`SELECT count(*) FROM "watermill_receipts"`)
		}
		done := s.Processed == 1 && s.Duplicates == 1 && s.DeadLettered == 3
		if done && relayed == 1 {
			break
		}
		if (!done && time.Now().After(deadline)) || time.Now().After(relayDeadline) {
			var dbg string
			_ = sch.Pool.QueryRow(ctx, "SELECT (SELECT string_agg(transaction_id::text, ',') FROM "+obCfg.MessagesTable()+") || ' xmin ' || pg_snapshot_xmin(pg_current_snapshot())::text || ' oldest ' || coalesce((SELECT backend_xid::text || ' ' || datname || ' ' || state || ' ' || left(query, 200) FROM pg_stat_activity WHERE backend_xid IS NOT NULL ORDER BY age(backend_xid) DESC LIMIT 1), '')").Scan(&dbg)
			t.Log(dbg)
			t.Fatalf("stats %+v, relayed %d (outbox rows %d); want 1 processed, 1 duplicate, 3 dead-lettered, 1 relayed", s, relayed, count("SELECT count(*) FROM "+obCfg.MessagesTable()))
		}
		time.Sleep(50 * time.Millisecond)
	}
	if b := count("SELECT balance FROM accounts WHERE id = 1"); b != 10 {
		t.Fatalf("balance %d, want 10", b)
	}
	if n := count(`SELECT count(*) FROM "watermill_billing_dead"`); n != 3 {
		t.Fatalf("%d dead letters on the broker, want 3", n)
	}
	for name, out := range map[string]string{"std": stdBuf.String(), "slog": slogBuf.String()} {
		if !strings.Contains(out, "query_args") {
			t.Fatalf("%s: no trace line of watermill-sql's query_args: the test did not log at trace level", name)
		}
		if strings.Contains(out, marker) {
			i := strings.Index(out, marker)
			t.Fatalf("%s: the payload marker was logged: ...%s...", name, out[max(0, i-300):min(len(out), i+100)])
		}
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(strings.TrimSpace(line), "level=ERROR msg=forged") || strings.ContainsAny(line, "\r\x1b") {
				t.Fatalf("%s: a forged or corrupted log line: %q", name, line)
			}
		}
	}
}

func jsonInt(n int64) string {
	b, _ := json.Marshal(n)
	return string(b)
}
