package main

import (
	"strings"
	"testing"
)

// everyDatabaseCommand is each command that connects, with the arguments it needs to get
// as far as connecting.
var everyDatabaseCommand = [][]string{
	{"migrate"},
	{"migrate", "--outbox"},
	{"partitions", "list"},
	{"partitions", "ensure"},
	{"partitions", "drop", "--older-than", "30d"},
	{"layout", "show"},
	{"layout", "convert", "--to", "compact", "--dry-run"},
	{"deferred", "migrate"},
	{"deferred", "replay", "--consumer", "billing", "--status", "dead"},
	{"deferred", "stats", "--consumer", "billing"},
	{"deferred", "purge", "--consumer", "billing", "--window", "14d"},
	{"purge", "--window", "14d"},
	{"stats"},
	{"dead", "list"},
	{"dead", "replay", "m-1", "--consumer", "billing"},
}

// cliConnForms are connection strings that make a command fail (an unreachable port, a
// string that does not parse, a bad parameter), each hiding "Hunter2pw" somewhere a
// connection string can hold a secret.
var cliConnForms = []string{
	"postgres://app:Hunter2pw@127.0.0.1:1/test?connect_timeout=2",
	"postgres://app:Hunter2pw@127.0.0.1:badport/test",
	"postgres://app:Hunter2pw@[::1/test",
	"postgres:app:Hunter2pw@127.0.0.1/test",
	"app:Hunter2pw@127.0.0.1:1/test",
	"postgres://app@127.0.0.1:1/test?connect_timeout=2&sslpassword=Hunter2pw",
	"postgres://app@127.0.0.1:1/test?password=Hunter2pw&sslmode=nonsense",
	"postgres://app@127.0.0.1:1/test?pass%77ord=Hunter2pw&sslmode=nonsense",
	"host=127.0.0.1 port=1 user=app password=Hunter2pw connect_timeout=2",
	"host=127.0.0.1 port=1 user=app password='Hunter2pw x' sslmode=nonsense",
	"host=127.0.0.1 port=1 user=app sslpassword=Hunter2pw sslkey=/nonexistent/key.pem sslcert=/nonexistent/cert.pem sslmode=require",
	"host=127.0.0.1 port=badport password=Hunter2pw",
}

// TestNoCommandPrintsASecret: every command that connects, given every form of connection
// string (flag, INBOX_DATABASE_URL, DATABASE_URL; the password also from PGPASSWORD and
// PGSSLPASSWORD), fails without the secret in its output or its error.
func TestNoCommandPrintsASecret(t *testing.T) {
	check := func(t *testing.T, args []string, out string, err error) {
		t.Helper()
		if err == nil {
			t.Errorf("%q succeeded", args)
		}
		if strings.Contains(out, "Hunter2pw") || (err != nil && strings.Contains(err.Error(), "Hunter2pw")) {
			t.Errorf("%q printed the secret:\n%s\n%v", args, out, err)
		}
	}
	for _, conn := range cliConnForms {
		for _, args := range everyDatabaseCommand {
			t.Run(args[0]+"/"+conn, func(t *testing.T) {
				t.Setenv("INBOX_DATABASE_URL", "")
				t.Setenv("DATABASE_URL", "")
				a := append(append([]string(nil), args...), "--database-url", conn)
				out, err := run(t, a...)
				check(t, a, out, err)
				for _, env := range databaseURLEnv {
					t.Setenv(env, conn)
					out, err := run(t, args...)
					check(t, append([]string{env}, args...), out, err)
					t.Setenv(env, "")
				}
			})
		}
	}
	for _, env := range []string{"PGPASSWORD", "PGSSLPASSWORD"} {
		t.Run(env, func(t *testing.T) {
			t.Setenv(env, "Hunter2pw")
			for _, args := range everyDatabaseCommand {
				a := append(append([]string(nil), args...), "--database-url", "postgres://app@127.0.0.1:1/test?connect_timeout=2&sslmode=nonsense")
				out, err := run(t, a...)
				check(t, a, out, err)
			}
		})
	}
}
