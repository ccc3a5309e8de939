package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/internal/ident"
	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// grantsCmd prints the GRANT statements of the application role (pgstore.GrantSQL, and
// outbox.GrantSQL with --outbox). It never connects.
func grantsCmd() *cobra.Command {
	var schema, table, role, outboxTopic, layout string
	var withOutbox, withDeferred bool
	var deferredTable string
	var broker brokerFlags
	cmd := &cobra.Command{
		Use:   "grants --role ROLE",
		Short: "Print the GRANT statements of an application role that only reads and writes",
		Long: "Prints, without connecting, the exact GRANT statements an application role needs to run\n" +
			"the inbox (with --deferred the store-then-process table, with --outbox the outbox and its\n" +
			"relay) and nothing more: no CREATE, so it\n" +
			"cannot create or alter tables. Run them as the schema's owner after `migrate`. The\n" +
			"handler's own tables need their own grants. With --broker-topics, also the postgres\n" +
			"broker's topic tables (created by `migrate --broker-topics`). See docs/security.md.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var l pgstore.Layout
			switch layout {
			case "text":
				l = pgstore.LayoutText
			case "compact":
				l = pgstore.LayoutCompact
			default:
				return usageError{fmt.Errorf("--layout %q: want text or compact", layout)}
			}
			script, err := pgstore.GrantSQL(pgstore.Config{Schema: schema, Table: table, Layout: l}, role)
			if err != nil {
				return err
			}
			if _, err := fmt.Fprint(cmd.OutOrStdout(), script); err != nil {
				return err
			}
			if withDeferred {
				// deferred.GrantSQL checks the role (pgstore.ValidateRole); the reserved
				// schema and table names are checked here.
				dt := deferredTable
				if dt == "" {
					dt = deferred.DefaultTable
				}
				if err := ident.GrantObject("table name", dt); err != nil {
					return err
				}
				d, err := deferred.GrantSQL(deferred.Config{Schema: schema, Table: deferredTable}, role)
				if err != nil {
					return err
				}
				if _, err := fmt.Fprint(cmd.OutOrStdout(), d); err != nil {
					return err
				}
			}
			if withOutbox {
				ob, err := outbox.GrantSQL(outbox.Config{Schema: schema, Topic: outboxTopic}, role)
				if err != nil {
					return err
				}
				if _, err = fmt.Fprint(cmd.OutOrStdout(), ob); err != nil {
					return err
				}
			}
			return broker.grants(cmd, role)
		},
	}
	broker.register(cmd)
	cmd.Flags().StringVar(&role, "role", "", "the application role (required)")
	cmd.Flags().StringVar(&schema, "schema", pgstore.DefaultSchema, "schema of the inbox table")
	cmd.Flags().StringVar(&table, "table", pgstore.DefaultTable, "inbox table name")
	cmd.Flags().StringVar(&layout, "layout", "text", "the inbox table's layout: text or compact (the compact layout adds its consumers table)")
	cmd.Flags().BoolVar(&withDeferred, "deferred", false, "also the store-then-process table (package middleware/deferred) in the same schema")
	cmd.Flags().StringVar(&deferredTable, "deferred-table", "", "the store-then-process table (default inbox_deferred)")
	cmd.Flags().BoolVar(&withOutbox, "outbox", false, "also the outbox tables (package middleware/outbox) in the same schema")
	cmd.Flags().StringVar(&outboxTopic, "outbox-topic", "", "the outbox topic (default "+outbox.DefaultTopic+")")
	_ = cmd.MarkFlagRequired("role")
	return cmd
}
