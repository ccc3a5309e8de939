package main

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// runMainEnv, set in the environment, makes the test binary run main() with its arguments,
// so a test can check the command's exit status without building it.
const runMainEnv = "WATERMILL_INBOX_TEST_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(runMainEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// uuidV7At returns a UUIDv7 whose timestamp is at.
func uuidV7At(t *testing.T, at time.Time) string {
	t.Helper()
	u, err := uuid.NewV7()
	if err != nil {
		t.Fatal(err)
	}
	ms := uint64(at.UnixMilli())
	for i := 0; i < 6; i++ {
		u[i] = byte(ms >> (40 - 8*i))
	}
	return u.String()
}

// TestPartitionsCommands runs list, ensure, drop --dry-run and drop against a partitioned
// table holding an old and a recent processed message: ensure creates the missing days,
// --dry-run changes nothing, drop removes exactly the expired partitions and their rows.
func TestPartitionsCommands(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	ctx := context.Background()
	store, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Table: "ops_inbox", Layout: pgstore.LayoutCompact,
		Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	db := []string{"--database-url", testenv.DatabaseURL(), "--schema", sch.Name, "--table", "ops_inbox"}
	now := time.Now()
	out, err := run(t, append([]string{"partitions", "ensure", "--back", "10d", "--lead", "72h"}, db...)...)
	if err != nil || !strings.Contains(out, "created ops_inbox_p"+now.Add(-10*24*time.Hour).UTC().Format("20060102")) ||
		!strings.Contains(out, "ops_inbox_p"+now.Add(72*time.Hour).UTC().Format("20060102")) {
		t.Fatalf("partitions ensure: %v\n%s", err, out)
	}
	claim := func(at time.Time) {
		tx, res, err := store.Claim(ctx, contract.Delivery{Key: contract.Key{MessageID: uuidV7At(t, at), ConsumerName: "billing"}})
		if err != nil || res.Decision != contract.Run {
			t.Fatalf("claim at %s: %+v %v", at, res, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	claim(now.Add(-9 * 24 * time.Hour))
	claim(now)
	count := func() (rows, parts int) {
		t.Helper()
		err := sch.Pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM ops_inbox), (SELECT count(*) FROM pg_inherits WHERE inhparent = 'ops_inbox'::regclass)").Scan(&rows, &parts)
		if err != nil {
			t.Fatal(err)
		}
		return rows, parts
	}
	rows, parts := count()
	if rows != 2 || parts != 14 {
		t.Fatalf("before drop: %d rows, %d partitions; want 2 and 14 (10 days back, today, 3 ahead)", rows, parts)
	}
	out, err = run(t, append([]string{"partitions", "list"}, db...)...)
	if err != nil || strings.Count(out, "ops_inbox_p") != 14 || !strings.Contains(out, "attached") {
		t.Fatalf("partitions list: %v\n%s", err, out)
	}
	out, err = run(t, append([]string{"partitions", "drop", "--older-than", "5d", "--dry-run"}, db...)...)
	if err != nil || !strings.Contains(out, "dry run: 5 partitions") {
		t.Fatalf("drop --dry-run: %v\n%s", err, out)
	}
	if r, p := count(); r != 2 || p != 14 {
		t.Fatalf("after --dry-run: %d rows, %d partitions; want nothing changed", r, p)
	}
	out, err = run(t, append([]string{"partitions", "drop", "--older-than", "5d"}, db...)...)
	if err != nil || !strings.Contains(out, "5 partitions dropped") || !strings.Contains(out, "dropped ops_inbox_p"+now.Add(-9*24*time.Hour).UTC().Format("20060102")) {
		t.Fatalf("drop: %v\n%s", err, out)
	}
	if r, p := count(); r != 1 || p != 9 {
		t.Fatalf("after drop: %d rows, %d partitions; want the recent row and 9 partitions", r, p)
	}
}

// TestPartitionsBadInput: bad flags, a table that is not partitioned, a missing or unusable
// database URL each give a clear error and their exit status (2 for a usage error, 1 for an
// unreachable database, as the binary exits); a password never appears.
func TestPartitionsBadInput(t *testing.T) {
	t.Setenv("INBOX_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"partitions", "drop"}, exitUsage, "--older-than is required"},
		{[]string{"partitions", "drop", "--older-than", "fortnight"}, exitUsage, `--older-than "fortnight"`},
		{[]string{"partitions", "drop", "--older-than", "10m"}, exitUsage, "refusing less than 1h"},
		{[]string{"partitions", "list", "--interval", "weekly"}, exitUsage, "want daily or hourly"},
		{[]string{"partitions", "ensure", "--lead", "-3h"}, exitUsage, "--lead"},
		{[]string{"partitions", "list", "--table", `x"; DROP TABLE y`}, exitUsage, "invalid configuration"},
		{[]string{"partitions", "list"}, exitUsage, "no database URL"},
		{[]string{"partitions", "list", "--bogus"}, exitUsage, "unknown flag"},
		{[]string{"partitions"}, exitUsage, "name a subcommand"},
		{[]string{"partitions", "list", "--database-url", "postgres://ops:s3cret@127.0.0.1:1/none?connect_timeout=2"}, exitError, "connect to postgres://ops:xxxxx@127.0.0.1:1/none"},
		{[]string{"partitions", "list", "--database-url", "postgres://ops:s3cret@[::1/none"}, exitUsage, "not a valid PostgreSQL URL"},
		{[]string{"migrate"}, exitUsage, "no database URL"},
		{[]string{"deferred", "stats", "--consumer", "billing"}, exitUsage, "no database URL"},
	} {
		out, err := run(t, tc.args...)
		if err == nil || exitCode(err) != tc.code || !strings.Contains(out, tc.want) || strings.Contains(out, "s3cret") {
			t.Errorf("%v: exit %d, err %v, output:\n%s\nwant exit %d, an error containing %q and no password", tc.args, exitCode(err), err, out, tc.code, tc.want)
		}
	}
	sch := testenv.NewSchema(t, 1)
	sch.Store(t) // a plain (text layout) inbox table
	out, err := run(t, "partitions", "list", "--database-url", testenv.DatabaseURL(), "--schema", sch.Name)
	if err == nil || !strings.Contains(out, "is not partitioned") {
		t.Fatalf("list on a plain table: %v\n%s", err, out)
	}
	// The binary's exit status: this test binary runs main() (see TestMain).
	c := exec.Command(os.Args[0], "partitions", "list", "--database-url", "postgres://ops:s3cret@127.0.0.1:1/none?connect_timeout=2")
	c.Env = append(os.Environ(), runMainEnv+"=1")
	b, err := c.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 || strings.Contains(string(b), "s3cret") || !strings.Contains(string(b), "connect to") {
		t.Fatalf("binary with an unreachable database: %v\n%s", err, b)
	}
}
