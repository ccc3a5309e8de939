package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

// testDB is a database created on the test PostgreSQL for one test.
type testDB struct {
	url, label string
	pool       *pgxpool.Pool
}

// newDatabases creates n databases named prefix_1..prefix_n on the PostgreSQL of
// testenv.DatabaseURL, each dropped when t ends; labels are host:port/name.
func newDatabases(t *testing.T, prefix string, n int) []testDB {
	t.Helper()
	admin := testenv.NewPool(t, testenv.DatabaseURL(), 1)
	base, err := url.Parse(testenv.DatabaseURL())
	if err != nil {
		t.Fatal(err)
	}
	port := base.Port()
	if port == "" {
		port = "5432"
	}
	dbs := make([]testDB, n)
	for i := range dbs {
		name := fmt.Sprintf("%s_%d", prefix, i+1)
		if _, err := admin.Exec(context.Background(), "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
			t.Fatalf("create database %s: %v", name, err)
		}
		t.Cleanup(func() {
			_, _ = admin.Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		})
		u := *base
		u.Path = "/" + name
		dbs[i] = testDB{url: u.String(), label: net.JoinHostPort(base.Hostname(), port) + "/" + name}
		dbs[i].pool = testenv.NewPool(t, dbs[i].url, 2) // closed before the database is dropped
	}
	return dbs
}

// closedPortURL is a URL with a password whose port nothing listens on, and its label.
func closedPortURL(t *testing.T) (string, string) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return "postgres://app:Hunter2pw@" + addr + "/nowhere?connect_timeout=2&sslmode=disable", addr + "/nowhere"
}

// dsnOf returns a URL of closedPortURL as a keyword/value string with the same password.
func dsnOf(t *testing.T, raw string) string {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	p, _ := u.User.Password()
	return fmt.Sprintf("host=%s port=%s dbname=%s user=%s password=%s connect_timeout=2 sslmode=disable", u.Hostname(), u.Port(), strings.TrimPrefix(u.Path, "/"), u.User.Username(), p)
}

func uniqueName(t *testing.T) string {
	t.Helper()
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return "t_multi_" + hex.EncodeToString(b)
}

// runSplit runs the command with its standard output and standard error apart.
func runSplit(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	cmd := rootCmd()
	var out, errb bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errb)
	cmd.SetArgs(args)
	err = cmd.ExecuteContext(context.Background())
	return out.String(), errb.String(), err
}

// lines returns the non-empty lines of s.
func lines(s string) []string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if l != "" {
			out = append(out, l)
		}
	}
	return out
}

func execIn(t *testing.T, db testDB, q string) {
	t.Helper()
	if _, err := db.pool.Exec(context.Background(), q); err != nil {
		t.Fatalf("%s: %v", db.label, err)
	}
}

func count(t *testing.T, db testDB, q string) int64 {
	t.Helper()
	var n int64
	if err := db.pool.QueryRow(context.Background(), q).Scan(&n); err != nil {
		t.Fatalf("%s: %s: %v", db.label, q, err)
	}
	return n
}

// TestCommandsOnSeveralDatabases: migrate, grants, purge, stats and the dead-letter commands
// run on three real databases and an unreachable one, named by repeated --database-url flags
// and a --databases-file with comments: each database gets one line (stats and dead list:
// one block; --json: one JSON line) labelled host:port/dbname, the unreachable one fails
// without stopping the others and without its password or URL printed, and the exit status
// is 1; the tables, grants and rows on each database are what the lines say.
func TestCommandsOnSeveralDatabases(t *testing.T) {
	t.Setenv("INBOX_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	prefix := uniqueName(t)
	role := prefix + "_app"
	admin := testenv.NewPool(t, testenv.DatabaseURL(), 1)
	if _, err := admin.Exec(context.Background(), "CREATE ROLE "+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // after the databases (and their grants) are dropped
		_, _ = admin.Exec(context.Background(), "DROP ROLE IF EXISTS "+pgx.Identifier{role}.Sanitize())
	})
	dbs := newDatabases(t, prefix, 3)
	closed, closedLabel := closedPortURL(t)
	file := filepath.Join(t.TempDir(), "databases")
	content := "# tenants b and c\n" + dbs[1].url + "\n\n   # a retired tenant: postgres://old@10.0.0.9/gone\n  " + dbs[2].url + "  \n"
	if err := os.WriteFile(file, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	all := []string{"--database-url", dbs[0].url, "--database-url", closed, "--databases-file", file}
	reachable := []string{"--database-url", dbs[0].url, "--databases-file", file}
	order := []string{dbs[0].label, closedLabel, dbs[1].label, dbs[2].label}

	// check asserts one line per database in list order, each "label: " + what it did.
	check := func(what, out string, want []string, err error, wantExit int) {
		t.Helper()
		if exitCode(err) != wantExit {
			t.Fatalf("%s: exit %d (%v), want %d\n%s", what, exitCode(err), err, wantExit, out)
		}
		ls := lines(out)
		if len(ls) != len(want) {
			t.Fatalf("%s: %d lines, want one per database (%d):\n%s", what, len(ls), len(want), out)
		}
		labels := order
		if len(want) == 3 {
			labels = []string{dbs[0].label, dbs[1].label, dbs[2].label}
		}
		for i, l := range ls {
			if !strings.HasPrefix(l, labels[i]+": ") || !strings.Contains(l, want[i]) {
				t.Errorf("%s: line %d = %q, want %q and %q", what, i+1, l, labels[i]+": ", want[i])
			}
		}
	}
	noSecret := func(what string, texts ...string) {
		t.Helper()
		for _, s := range texts {
			if strings.Contains(s, "Hunter2pw") || strings.Contains(s, "postgres://") {
				t.Errorf("%s printed a password or a URL:\n%s", what, s)
			}
		}
	}
	exists := func(db testDB, table string) bool {
		t.Helper()
		var ok bool
		if err := db.pool.QueryRow(context.Background(), "SELECT to_regclass($1) IS NOT NULL", table).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}

	// migrate: the three get their tables, the closed port fails, exit 1.
	out, errOut, err := runSplit(t, append([]string{"migrate", "--outbox"}, all...)...)
	check("migrate", out, []string{"applied migrations [1 2 3 4 5]; outbox tables", "error: ", "applied migrations", "applied migrations"}, err, exitError)
	if !strings.Contains(errOut, "1 of 4 databases failed: "+closedLabel) {
		t.Errorf("migrate: the error names the failed database: %q", errOut)
	}
	noSecret("migrate", out, errOut, err.Error())
	for _, db := range dbs {
		if !exists(db, "public.inbox_processed_messages") || !exists(db, "public.inbox_processed_messages_attempts") || !exists(db, "public.watermill_inbox_outbox") {
			t.Fatalf("%s: the inbox and outbox tables are missing after migrate", db.label)
		}
	}
	out, _, err = runSplit(t, append([]string{"migrate"}, reachable...)...)
	check("migrate again", out, []string{"is up to date", "is up to date", "is up to date"}, err, exitOK)

	// grants: run on each database, not printed.
	out, errOut, err = runSplit(t, append([]string{"grants", "--role", role, "--outbox"}, all...)...)
	check("grants", out, []string{`granted to role "` + role + `": 9 GRANT statements`, "error: ", "granted", "granted"}, err, exitError)
	noSecret("grants", out, errOut)
	for _, db := range dbs {
		var ok bool
		if err := db.pool.QueryRow(context.Background(), "SELECT has_table_privilege($1, 'public.inbox_processed_messages', 'INSERT') AND has_table_privilege($1, 'public.watermill_inbox_outbox', 'DELETE')", role).Scan(&ok); err != nil || !ok {
			t.Fatalf("%s: role %s lacks the grants (%v)", db.label, role, err)
		}
	}

	// purge: 3, 5 and 7 rows past the window, one inside it in each.
	for i, db := range dbs {
		if _, err := db.pool.Exec(context.Background(), `INSERT INTO inbox_processed_messages (message_id, consumer_name, received_at)
			SELECT 'old' || g, 'billing', now() - interval '20 days' FROM generate_series(1, $1::int) g
			UNION ALL SELECT 'new', 'billing', now()`, 3+2*i); err != nil {
			t.Fatal(err)
		}
	}
	out, errOut, err = runSplit(t, append([]string{"purge", "--window", "14d", "--pause", "1ms"}, all...)...)
	check("purge", out, []string{"total: deleted 3 rows", "error: ", "total: deleted 5 rows", "total: deleted 7 rows"}, err, exitError)
	noSecret("purge", out, errOut)
	if !strings.Contains(errOut, dbs[2].label+": purge inbox ") {
		t.Errorf("purge: progress lines are labelled: %q", errOut)
	}
	for _, db := range dbs {
		if n := count(t, db, "SELECT count(*) FROM inbox_processed_messages"); n != 1 {
			t.Errorf("%s: %d rows after the purge, want the 1 inside the window", db.label, n)
		}
	}

	// stats: a block per database, headed by its label.
	execIn(t, dbs[1], "INSERT INTO inbox_processed_messages (message_id, consumer_name) VALUES ('b1', 'shipping'), ('b2', 'shipping')")
	out, errOut, err = runSplit(t, append([]string{"stats"}, all...)...)
	if exitCode(err) != exitError {
		t.Fatalf("stats: exit %d, %v", exitCode(err), err)
	}
	noSecret("stats", out, errOut)
	blocks := strings.Split(out, "\n\n")
	if len(blocks) != 4 {
		t.Fatalf("stats: %d blocks, want 4:\n%s", len(blocks), out)
	}
	for i, want := range []string{"rows             1\n", "error: ", "rows             3\n", "rows             1\n"} {
		if !strings.HasPrefix(blocks[i], "== "+order[i]+" ==\n") || !strings.Contains(blocks[i], want) {
			t.Errorf("stats: block %d, want the header of %s and %q:\n%s", i+1, order[i], want, blocks[i])
		}
	}
	if !strings.Contains(blocks[2], `consumer         "shipping": 2 rows`) {
		t.Errorf("stats: block of %s:\n%s", dbs[1].label, blocks[2])
	}

	// stats --json: one JSON object a line.
	out, _, err = runSplit(t, append([]string{"stats", "--json"}, all...)...)
	if exitCode(err) != exitError || len(lines(out)) != 4 {
		t.Fatalf("stats --json: exit %d, %v\n%s", exitCode(err), err, out)
	}
	for i, l := range lines(out) {
		var v struct {
			Database string `json:"database"`
			Result   *struct {
				Rows int64 `json:"rows"`
			} `json:"result"`
			Error string `json:"error"`
		}
		if err := json.Unmarshal([]byte(l), &v); err != nil || v.Database != order[i] || (i == 1) != (v.Error != "") || (i != 1 && v.Result == nil) {
			t.Fatalf("stats --json line %d: %v: %s", i+1, err, l)
		}
		if i == 2 && v.Result.Rows != 3 {
			t.Errorf("stats --json: %s has %d rows, want 3", v.Database, v.Result.Rows)
		}
	}

	// dead list, replay and discard: the dead letters of b and c.
	execIn(t, dbs[1], "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, attempts, dead_lettered_at, dead_letter_reason) VALUES ('p1', 'billing', 5, now(), 'failed 5 of 5 attempts')")
	execIn(t, dbs[2], "INSERT INTO inbox_processed_messages_attempts (message_id, consumer_name, attempts, dead_lettered_at, dead_letter_reason) VALUES ('p2', 'billing', 5, now(), 'failed 5 of 5 attempts'), ('p3', 'billing', 1, now(), 'permanent error: bad')")
	out, _, err = runSplit(t, append([]string{"dead", "list"}, all...)...)
	blocks = strings.Split(out, "\n\n")
	if exitCode(err) != exitError || len(blocks) != 4 || strings.Contains(blocks[0], "billing") ||
		!strings.Contains(blocks[2], "count=1") || !strings.Contains(blocks[3], `reason="permanent error: bad"`) {
		t.Fatalf("dead list: exit %d, %v\n%s", exitCode(err), err, out)
	}
	out, _, err = runSplit(t, append([]string{"dead", "replay", "--consumer", "billing", "--reason", "failed 5 of 5 attempts"}, reachable...)...)
	check("dead replay", out, []string{"0 cleared", `cleared "p1"; 1 cleared`, `cleared "p2"; 1 cleared`}, err, exitOK)
	out, _, err = runSplit(t, append([]string{"dead", "discard", "--consumer", "billing", "--reason", "permanent error: bad"}, all...)...)
	check("dead discard", out, []string{"0 discarded", "error: ", "0 discarded", "1 discarded"}, err, exitError)
	for _, db := range dbs {
		if n := count(t, db, "SELECT count(*) FROM inbox_processed_messages_attempts"); n != 0 {
			t.Errorf("%s: %d attempt records left after replay and discard", db.label, n)
		}
	}
}

// TestOneDatabaseIsAsBefore: one database, named by --database-url, by a --databases-file of
// one line or by INBOX_DATABASE_URL, prints exactly what the command always printed (no
// label) and returns the error as it was (its exit status, no count of databases).
func TestOneDatabaseIsAsBefore(t *testing.T) {
	t.Setenv("INBOX_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	db := newDatabases(t, uniqueName(t), 1)[0]
	file := filepath.Join(t.TempDir(), "one")
	if err := os.WriteFile(file, []byte("# the only one\n"+db.url+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, _, err := runSplit(t, "migrate", "--databases-file", file); err != nil || out != `"public"."inbox_processed_messages": applied migrations [1 2 3 4 5]`+"\n" {
		t.Fatalf("migrate from a file of one: %v\n%q", err, out)
	}
	execIn(t, db, "INSERT INTO inbox_processed_messages (message_id, consumer_name) VALUES ('k', 'billing')")
	byFlag, _, err1 := runSplit(t, "stats", "--database-url", db.url)
	byFile, _, err2 := runSplit(t, "stats", "--databases-file", file)
	t.Setenv("INBOX_DATABASE_URL", db.url)
	byEnv, _, err3 := runSplit(t, "stats")
	if err1 != nil || err2 != nil || err3 != nil || !strings.HasPrefix(byFlag, "table            \"public\".\"inbox_processed_messages\"\n") ||
		byFile != byFlag || byEnv != byFlag || strings.Contains(byFlag, db.label) {
		t.Fatalf("stats of one database: %v %v %v\nflag:\n%s\nfile:\n%s\nenv:\n%s", err1, err2, err3, byFlag, byFile, byEnv)
	}
	t.Setenv("INBOX_DATABASE_URL", "")

	// One failing database: its own error and exit status, unlabelled, masked.
	closed, _ := closedPortURL(t)
	_, _, err := runSplit(t, "dead", "replay", "k", "--consumer", "billing", "--database-url", db.url)
	var many *databasesError
	if exitCode(err) != exitError || errors.As(err, &many) || !strings.Contains(err.Error(), "not dead-lettered") {
		t.Errorf("dead replay of a key not dead-lettered: %v", err)
	}
	_, _, err = runSplit(t, "stats", "--database-url", closed)
	if exitCode(err) != exitError || errors.As(err, &many) || strings.Contains(err.Error(), "Hunter2pw") {
		t.Errorf("stats of an unreachable database: %v", err)
	}
	// A URL from the file: masked as one from the flag.
	_ = os.WriteFile(file, []byte(closed+"\n"), 0o600)
	if _, _, err = runSplit(t, "stats", "--databases-file", file); exitCode(err) != exitError || strings.Contains(err.Error(), "Hunter2pw") {
		t.Errorf("stats of an unreachable database from a file: %v", err)
	}
	// grants without a database prints as before, even with INBOX_DATABASE_URL set.
	t.Setenv("INBOX_DATABASE_URL", closed)
	if out, _, err := runSplit(t, "grants", "--role", "app"); err != nil || !strings.HasPrefix(out, `-- the inbox "public"."inbox_processed_messages": application role "app"`) {
		t.Errorf("grants: %v\n%s", err, out)
	}
}

// TestDatabaseListRefusals: a missing or empty --databases-file, a database named twice and
// a failing purge lock are reported as they should be: the list's errors as usage errors
// (exit 2) before anything connects, never with the file's content.
func TestDatabaseListRefusals(t *testing.T) {
	t.Setenv("INBOX_DATABASE_URL", "")
	t.Setenv("DATABASE_URL", "")
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty")
	_ = os.WriteFile(empty, []byte("# none yet\n"), 0o600)
	twice := filepath.Join(dir, "twice")
	_ = os.WriteFile(twice, []byte("postgres://app:Hunter2pw@127.0.0.1:1/a\n"), 0o600)
	// Two unreachable databases from a file, each with a password: each fails on its line,
	// masked, and the exit status is 1.
	closed1, label1 := closedPortURL(t)
	closed2, label2 := closedPortURL(t)
	two := filepath.Join(dir, "two")
	_ = os.WriteFile(two, []byte(closed1+"\n"+dsnOf(t, closed2)+"\n"), 0o600)
	out, errOut, err := runSplit(t, "dead", "list", "--databases-file", two)
	if exitCode(err) != exitError || strings.Contains(out+errOut, "Hunter2pw") || strings.Count(out, "==\nerror: ") != 2 ||
		!strings.Contains(out, "== "+label1+" ==") || !strings.Contains(out, "== "+label2+" ==") {
		t.Errorf("dead list of two unreachable databases: exit %d, %v\n%s%s", exitCode(err), err, out, errOut)
	}
	for _, args := range [][]string{
		{"stats", "--databases-file", filepath.Join(dir, "missing")},
		{"migrate", "--databases-file", empty},
		{"purge", "--window", "14d", "--database-url", "postgres://other@127.0.0.1:1/a", "--databases-file", twice},
		{"grants", "--role", "app", "--databases-file", empty},
	} {
		out, errOut, err := runSplit(t, args...)
		if exitCode(err) != exitUsage || strings.Contains(out+errOut+fmt.Sprint(err), "Hunter2pw") {
			t.Errorf("%v: exit %d, %v\n%s%s", args, exitCode(err), err, out, errOut)
		}
	}
}
