package postgres_test

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/adapters/postgres"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// stackFrame matches a Go stack frame as pkg/errors prints it with %+v ("file.go:123").
var stackFrame = regexp.MustCompile(`\.go:\d+`)

// TestNoDDLAsLeastPrivilegedRole: the owner creates the topic tables (postgres.Migrate, what
// `watermill-inbox migrate --broker-topics` runs) and a role gets exactly what pgstore.GrantSQL
// and postgres.GrantSQL print (no CREATE anywhere); on a NoDDL broker, through package router,
// that role publishes and consumes, and the inbox dedups (ledger rows). A topic without tables
// and a topic without grants fail Run at once, with an error that names the table or the
// privilege, wraps postgres.ErrTopicNotReady and inbox.ErrInvalidConfig, prints no stack
// frame even with %+v, and the router closes at once.
func TestNoDDLAsLeastPrivilegedRole(t *testing.T) {
	ctx := context.Background()
	sch := testenv.NewSchema(t, 8)
	sch.Store(t) // the inbox tables, migrated by the owner
	sch.Exec(t, "CREATE TABLE ledger (message_id text PRIMARY KEY)")
	bcfg := postgres.Config{Schema: sch.Name, NoDDL: true, PollInterval: 20 * time.Millisecond}
	entries, ungranted, missing := "entries", "ungranted", "never_migrated"
	if err := postgres.Migrate(ctx, sch.Pool, bcfg, entries, ungranted); err != nil {
		t.Fatal(err)
	}
	_, roleURL := testenv.GrantedRole(t, sch, func(role string) (string, error) {
		grants, err := pgstore.GrantSQL(pgstore.Config{Schema: sch.Name}, role)
		if err != nil {
			return "", err
		}
		topics, err := postgres.GrantSQL(bcfg, role, entries)
		return grants + topics + "GRANT SELECT, INSERT ON ledger TO " + pgx.Identifier{role}.Sanitize() + ";\n", err
	})
	pool := testenv.NewPool(t, roleURL, 8)
	store, err := pgstore.New(pool, pgstore.Config{Schema: sch.Name})
	if err != nil {
		t.Fatal(err)
	}
	cfg := router.Config{Broker: postgres.Name, ConsumerGroupPrefix: sch.Name + "_", Settings: map[string]any{postgres.Name: bcfg}}

	r, err := router.New(cfg, pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	ib, err := r.NewInbox(inbox.Config{Store: store, ConsumerName: "ledger"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.AddConsumer(ib, entries, func(msg *message.Message) error {
		tx, _ := pgstore.TxFromContext(msg.Context())
		_, err := tx.Exec(msg.Context(), "INSERT INTO ledger VALUES ($1)", msg.UUID)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	testenv.RunRouter(t, r.Router)
	t.Cleanup(func() { _ = r.Close() })
	for _, id := range []string{"e-1", "e-2", "e-1"} {
		if err := r.Broker.Publisher.Publish(entries, message.NewMessage(id, []byte(`{}`))); err != nil {
			t.Fatalf("publish as the least-privileged role: %v", err)
		}
	}
	// watermill-sql delivers a row only once every transaction older than it ended, anywhere
	// in the cluster: another test's long transaction delays it.
	deadline := time.Now().Add(60 * time.Second)
	for ib.Stats().Processed+ib.Stats().Duplicates < 3 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	var rows int
	_ = sch.Pool.QueryRow(ctx, "SELECT count(*) FROM ledger").Scan(&rows)
	if s := ib.Stats(); rows != 2 || s.Processed != 2 || s.Duplicates != 1 {
		t.Fatalf("ledger rows %d, stats %+v; want 2 rows, 2 processed, 1 duplicate", rows, s)
	}

	for _, c := range []struct{ topic, want string }{
		{missing, `"watermill_never_migrated" does not exist`},
		{ungranted, `lacks SELECT on "` + sch.Name + `"."watermill_ungranted"`},
	} {
		t.Run(c.topic, func(t *testing.T) {
			r, err := router.New(cfg, pool, nil)
			if err != nil {
				t.Fatal(err)
			}
			ib, err := r.NewInbox(inbox.Config{Store: store, ConsumerName: "ledger"}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := r.AddConsumer(ib, c.topic, func(*message.Message) error { return nil }); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			runErr := r.Run(ctx)
			if err := r.Close(); err != nil {
				t.Errorf("Close after the failed Run: %v", err)
			}
			took := time.Since(start)
			msg := fmt.Sprintf("%+v", runErr)
			t.Logf("Run: %s (Run and Close took %v)", msg, took)
			switch {
			case !errors.Is(runErr, postgres.ErrTopicNotReady) || !errors.Is(runErr, inbox.ErrInvalidConfig):
				t.Fatalf("Run = %v; want postgres.ErrTopicNotReady and inbox.ErrInvalidConfig", runErr)
			case !strings.Contains(msg, c.want) || !strings.Contains(msg, "--broker-topics "+c.topic):
				t.Errorf("error %q names neither %q nor the command that fixes it", msg, c.want)
			case stackFrame.MatchString(msg):
				t.Errorf("error printed with %%+v holds stack frames: %q", msg)
			case took > 5*time.Second:
				t.Errorf("Run and Close took %v; want a prompt exit", took)
			}
			err = r.Broker.Publisher.Publish(c.topic, message.NewMessage("p-1", []byte(`{}`)))
			if !errors.Is(err, postgres.ErrTopicNotReady) {
				t.Errorf("Publish to %s: %v, want postgres.ErrTopicNotReady", c.topic, err)
			}
		})
	}
}

// TestSchemaAndGrantSQL: the printed DDL is watermill-sql's own for BYTEA payloads, with one
// advisory lock for the whole script, and the grants cover each table and its sequence.
func TestSchemaAndGrantSQL(t *testing.T) {
	cfg := postgres.Config{Schema: "billing"}
	ddl, err := postgres.SchemaSQL(cfg, "payments", "receipts")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`CREATE TABLE IF NOT EXISTS "billing"."watermill_payments" (`, `"payload" BYTEA`,
		`CREATE TABLE IF NOT EXISTS "billing"."watermill_offsets_receipts" (`,
	} {
		if !strings.Contains(ddl, want) {
			t.Errorf("SchemaSQL lacks %q:\n%s", want, ddl)
		}
	}
	if n := strings.Count(ddl, "pg_advisory_xact_lock"); n != 1 {
		t.Errorf("%d advisory locks, want 1:\n%s", n, ddl)
	}
	grants, err := postgres.GrantSQL(cfg, "app", "payments")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`GRANT USAGE ON SCHEMA "billing" TO "app";`,
		`GRANT SELECT, INSERT ON "billing"."watermill_payments" TO "app";`,
		`GRANT USAGE ON SEQUENCE "billing"."watermill_payments_offset_seq" TO "app";`,
		`GRANT SELECT, INSERT, UPDATE ON "billing"."watermill_offsets_payments" TO "app";`,
	} {
		if !strings.Contains(grants, want) {
			t.Errorf("GrantSQL lacks %q:\n%s", want, grants)
		}
	}
	for _, bad := range []string{"", "pay ments", `x"; DROP TABLE y; --`} {
		if _, err := postgres.SchemaSQL(cfg, bad); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("SchemaSQL(%q): %v, want inbox.ErrInvalidConfig", bad, err)
		}
	}
}
