package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/internal/ident"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// grantsCmd prints the GRANT statements of the application role (pgstore.GrantSQL, and
// outbox.GrantSQL with --outbox). Without --database-url or --databases-file it never
// connects; with them, it runs the statements on each database instead of printing them.
func grantsCmd() *cobra.Command {
	var g grantFlags
	var dbs dbFlags
	cmd := &cobra.Command{
		Use:   "grants --role ROLE",
		Short: "Print the GRANT statements of an application role that only reads and writes",
		Long: "Prints, without connecting, the exact GRANT statements an application role needs to run\n" +
			"the inbox (with --deferred the store-then-process table, with --outbox the outbox and its\n" +
			"relay) and nothing more: no CREATE, so it\n" +
			"cannot create or alter tables. Run them as the schema's owner after `migrate`. The\n" +
			"handler's own tables need their own grants. With --broker-topics, also the postgres\n" +
			"broker's topic tables (created by `migrate --broker-topics`). With --database-url\n" +
			"(repeatable) or --databases-file, runs the statements on each database, in one\n" +
			"transaction each, instead of printing them (the environment's URL is never used\n" +
			"here). See docs/security.md.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var script strings.Builder
			if err := g.script(&script); err != nil {
				return err
			}
			if !dbs.given() {
				_, err := fmt.Fprint(cmd.OutOrStdout(), script.String())
				return err
			}
			list, err := dbs.list(func() string { return "" })
			if err != nil {
				return err
			}
			return eachDatabase(cmd, list, oneLine, func(cmd *cobra.Command, url string) error {
				return applyGrants(cmd, url, script.String(), g.role)
			})
		},
	}
	g.broker.register(cmd)
	dbs.register(cmd, "run the statements on this database instead of printing them (repeatable; the schema's owner's URL)")
	cmd.Flags().StringVar(&g.role, "role", "", "the application role (required)")
	cmd.Flags().StringVar(&g.schema, "schema", pgstore.DefaultSchema, "schema of the inbox table")
	cmd.Flags().StringVar(&g.table, "table", pgstore.DefaultTable, "inbox table name")
	cmd.Flags().StringVar(&g.layout, "layout", "text", "the inbox table's layout: text or compact (the compact layout adds its consumers table)")
	cmd.Flags().BoolVar(&g.withDeferred, "deferred", false, "also the store-then-process table (package middleware/deferred) in the same schema")
	cmd.Flags().StringVar(&g.deferredTable, "deferred-table", "", "the store-then-process table (default inbox_deferred)")
	cmd.Flags().BoolVar(&g.withOutbox, "outbox", false, "also the outbox tables (package middleware/outbox) in the same schema")
	cmd.Flags().StringVar(&g.outboxTopic, "outbox-topic", "", "the outbox topic (default "+outbox.DefaultTopic+")")
	_ = cmd.MarkFlagRequired("role")
	return cmd
}

// grantFlags are what `grants` grants, and to whom.
type grantFlags struct {
	schema, table, role, outboxTopic, layout string
	withOutbox, withDeferred                 bool
	deferredTable                            string
	broker                                   brokerFlags
}

// script writes the GRANT statements to w: the inbox's, then the store-then-process
// table's, the outbox's and the broker topics' when asked. Invalid names and roles are
// errors before anything is written.
func (g *grantFlags) script(w io.Writer) error {
	var l pgstore.Layout
	switch g.layout {
	case "text":
		l = pgstore.LayoutText
	case "compact":
		l = pgstore.LayoutCompact
	default:
		return usageError{fmt.Errorf("--layout %q: want text or compact", g.layout)}
	}
	script, err := pgstore.GrantSQL(pgstore.Config{Schema: g.schema, Table: g.table, Layout: l}, g.role)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprint(w, script); err != nil {
		return err
	}
	if g.withDeferred {
		// deferred.GrantSQL checks the role (pgstore.ValidateRole); the reserved
		// schema and table names are checked here.
		dt := g.deferredTable
		if dt == "" {
			dt = deferred.DefaultTable
		}
		if err := ident.GrantObject("table name", dt); err != nil {
			return err
		}
		d, err := deferred.GrantSQL(deferred.Config{Schema: g.schema, Table: g.deferredTable}, g.role)
		if err != nil {
			return err
		}
		if _, err := fmt.Fprint(w, d); err != nil {
			return err
		}
	}
	if g.withOutbox {
		ob, err := outbox.GrantSQL(outbox.Config{Schema: g.schema, Topic: g.outboxTopic}, g.role)
		if err != nil {
			return err
		}
		if _, err = fmt.Fprint(w, ob); err != nil {
			return err
		}
	}
	return g.broker.grants(w, g.role)
}

// applyGrants runs script (GRANT statements) on the database at url in one transaction (one
// simple-protocol query) and prints how many statements ran for role.
func applyGrants(cmd *cobra.Command, url, script, role string) error {
	if url == "" {
		return usageError{errors.New("no database URL: pass --database-url")}
	}
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return usageError{fmt.Errorf("database URL: %w", err)} // pgx redacts the password
	}
	pcfg.MaxConns = 1
	ctx, cancel := context.WithTimeout(cmd.Context(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer pool.Close()
	// One simple-protocol query of several statements runs as one implicit transaction.
	if _, err := pool.Exec(ctx, script); err != nil {
		return fmt.Errorf("grants: %w", err)
	}
	n := 0
	for _, line := range strings.Split(script, "\n") {
		if strings.HasPrefix(line, "GRANT ") {
			n++
		}
	}
	_, err = fmt.Fprintf(cmd.OutOrStdout(), "granted to role %q: %d GRANT statements\n", role, n)
	return err
}
