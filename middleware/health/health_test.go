package health_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/health"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// forwarder listens on addr and forwards every connection to target until closed.
type forwarder struct {
	ln    net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

func listenForward(t *testing.T, addr, target string) *forwarder {
	t.Helper()
	var ln net.Listener
	var err error
	for range 50 { // the port was just closed; it is normally free at once
		if ln, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("listen again on %s: %v", addr, err)
	}
	f := &forwarder{ln: ln}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			f.mu.Lock()
			f.conns = append(f.conns, c, s)
			f.mu.Unlock()
			go func() { _, _ = io.Copy(s, c); _ = s.Close() }()
			go func() { _, _ = io.Copy(c, s); _ = c.Close() }()
		}
	}()
	t.Cleanup(f.close)
	return f
}

func (f *forwarder) close() {
	_ = f.ln.Close()
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range f.conns {
		_ = c.Close()
	}
}

func get(t *testing.T, h http.Handler) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	return rec.Code, rec.Body.String()
}

// TestReadinessDatabaseDownAndBack points a pool at a closed loopback port (PostgreSQL itself
// keeps running): readiness fails with 503 naming the database; once the port forwards to
// PostgreSQL, it recovers.
func TestReadinessDatabaseDownAndBack(t *testing.T) {
	testenv.SkipShort(t, "PostgreSQL")
	target := testenv.DatabaseHostPort(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close() // nothing listens there now: connection refused
	cfg, err := pgxpool.ParseConfig(testenv.WithHost(t, testenv.DatabaseURL(), addr))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 2
	cfg.ConnConfig.ConnectTimeout = time.Second
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ready := health.NewReadiness(health.Config{Timeout: 2 * time.Second}, health.Database(pool))

	_, err = ready.Check(context.Background())
	var nr *health.NotReadyError
	if !errors.As(err, &nr) || !strings.Contains(err.Error(), "database unreachable") {
		t.Fatalf("with the database unreachable: %v, want a NotReadyError naming the database", err)
	}
	if code, body := get(t, ready); code != http.StatusServiceUnavailable || !strings.Contains(body, `"not ready"`) || !strings.Contains(body, `"database"`) {
		t.Fatalf("handler with the database unreachable: %d %s", code, body)
	}
	if strings.Contains(err.Error(), "password") {
		t.Fatalf("the error mentions a password: %v", err)
	}

	listenForward(t, addr, target)
	if _, err := ready.Check(context.Background()); err != nil {
		t.Fatalf("after the database came back: %v", err)
	}
	if code, body := get(t, ready); code != http.StatusOK || !strings.Contains(body, `"ready"`) {
		t.Fatalf("handler after recovery: %d %s", code, body)
	}
}

// TestReadinessMissingMigration removes a migration's record (as a schema migrated by an older
// release would lack it): readiness fails naming the migration; Migrate makes it ready again.
func TestReadinessMissingMigration(t *testing.T) {
	s := testenv.NewSchema(t, 3)
	store := s.Store(t)
	ready := health.NewReadiness(health.Config{}, health.Database(s.Pool), health.Migrations(store))
	if _, err := ready.Check(context.Background()); err != nil {
		t.Fatalf("freshly migrated: %v", err)
	}
	s.Exec(t, "DELETE FROM "+s.Name+".watermill_inbox_migrations WHERE version = 2")
	_, err := ready.Check(context.Background())
	if !errors.Is(err, health.ErrMigrationsMissing) || !strings.Contains(err.Error(), "0002_create_attempts.sql") {
		t.Fatalf("with migration 2 missing: %v, want ErrMigrationsMissing naming 0002_create_attempts.sql", err)
	}
	if code, body := get(t, ready); code != http.StatusServiceUnavailable || !strings.Contains(body, "0002_create_attempts.sql") {
		t.Fatalf("handler with a missing migration: %d %s", code, body)
	}
	if _, err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := ready.Check(context.Background()); err != nil {
		t.Fatalf("after Migrate: %v", err)
	}

	// A schema never migrated: the versions table is missing.
	s.Exec(t, "DROP TABLE "+s.Name+".watermill_inbox_migrations")
	if _, err := ready.Check(context.Background()); !errors.Is(err, health.ErrMigrationsMissing) {
		t.Fatalf("without the versions table: %v", err)
	}
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// TestReadinessDeadLetters: an inbox required to dead-letter without a dead-letter topic is
// not ready.
func TestReadinessDeadLetters(t *testing.T) {
	s := testenv.NewSchema(t, 2)
	store := s.Store(t)
	with, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing", DeadLetterPublisher: nopPublisher{}, DeadLetterTopic: "dead"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	without, err := inbox.New(inbox.Config{Store: store, ConsumerName: "shipping"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := health.NewReadiness(health.Config{}, health.DeadLetters(with)).Check(context.Background()); err != nil {
		t.Fatal(err)
	}
	_, err = health.NewReadiness(health.Config{}, health.DeadLetters(with, without)).Check(context.Background())
	if !errors.Is(err, health.ErrNoDeadLetterTopic) || !strings.Contains(err.Error(), "shipping") || strings.Contains(err.Error(), "billing") {
		t.Fatalf("%v, want ErrNoDeadLetterTopic naming shipping only", err)
	}
}
