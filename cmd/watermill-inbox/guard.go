package main

import (
	"os"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/watermill-inbox/watermill-inbox/internal/ident"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
)

// databaseURLEnv are the environment variables the database URL is read from (storeFlags.url).
var databaseURLEnv = []string{"INBOX_DATABASE_URL", "DATABASE_URL"}

// guard makes two rules hold for every command under root, in one place:
//
//   - the names of its --schema, --table and --deferred-table flags are checked before it
//     runs (pgstore.ValidateGrantObject: no pg_ prefix, no information_schema), a usage
//     error;
//   - every error it returns, its flag and argument errors included, has the secrets of every
//     connection string in reach (each --database-url, INBOX_DATABASE_URL, DATABASE_URL,
//     PGPASSWORD, PGSSLPASSWORD) masked by redact.Conn before cobra prints it (the URLs of a
//     --databases-file are masked where they are used, by eachDatabase).
func guard(root *cobra.Command) {
	root.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
		for _, name := range []string{"schema", "table", "deferred-table"} {
			f := cmd.Flags().Lookup(name)
			if f == nil || f.Value.String() == "" {
				continue
			}
			what := "table name"
			if name == "schema" {
				what = "schema name"
			}
			if err := ident.GrantObject(what, f.Value.String()); err != nil {
				return usageError{err}
			}
		}
		return nil
	}
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error { return usageError{mask(cmd, err)} })
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		if run := c.RunE; run != nil {
			c.RunE = func(cmd *cobra.Command, args []string) error { return mask(cmd, run(cmd, args)) }
		}
		if pre := c.PersistentPreRunE; pre != nil {
			c.PersistentPreRunE = func(cmd *cobra.Command, args []string) error { return mask(cmd, pre(cmd, args)) }
		}
		if v := c.Args; v != nil {
			c.Args = func(cmd *cobra.Command, args []string) error { return mask(cmd, v(cmd, args)) }
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(root)
}

// mask is redact.ConnErr with the connection strings in reach of cmd (each --database-url)
// and extra (those of a --databases-file); a usageError stays one.
func mask(cmd *cobra.Command, err error, extra ...string) error {
	if err == nil {
		return nil
	}
	conns := make([]string, 0, 3+len(extra))
	for _, e := range databaseURLEnv {
		conns = append(conns, os.Getenv(e))
	}
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if f.Name != "database-url" {
			return
		}
		if s, ok := f.Value.(pflag.SliceValue); ok {
			conns = append(conns, s.GetSlice()...)
		} else {
			conns = append(conns, f.Value.String())
		}
	})
	conns = append(conns, extra...)
	if u, ok := err.(usageError); ok {
		return usageError{redact.ConnErr(u.err, conns...)}
	}
	return redact.ConnErr(err, conns...)
}
