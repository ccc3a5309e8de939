// Command watermill-inbox is the operator's tool for the inbox table.
//
//	watermill-inbox migrate                  # apply pending migrations
//	watermill-inbox migrate --print          # print the SQL for your own migration tool
//	watermill-inbox migrate --schema billing --table inbox
//	watermill-inbox migrate --outbox         # also the outbox tables (topic inbox_outbox)
//	watermill-inbox migrate --layout compact # a new table in the compact layout
//	watermill-inbox layout show              # the table's layout, read from the catalog
//	watermill-inbox layout convert --to compact [--partitioned daily] [--dry-run | --print]
//	watermill-inbox deferred migrate         # the store-then-process table (see deferred.go)
//	watermill-inbox deferred replay --consumer billing --status dead
//	watermill-inbox deferred purge --consumer billing --window 14d [--dry-run]
//	watermill-inbox grants --role app --outbox   # the application role's GRANT statements
//	watermill-inbox --version
//
//	watermill-inbox purge --window 14d [--dry-run] [--topic inbox_outbox]
//	watermill-inbox stats [--json]
//	watermill-inbox dead list [--consumer billing] [--since 24h] [--records] [--json]
//	watermill-inbox dead replay <message-id> --consumer billing
//	watermill-inbox dead replay --consumer billing --reason "..." --since 2026-11-30T00:00:00Z --until 2h [--dry-run]
//	watermill-inbox dead discard --consumer billing --reason "..." [--since T] [--until T] [--dry-run]
//
// The database URL comes from --database-url or INBOX_DATABASE_URL (or DATABASE_URL). Errors
// are printed to standard error; a URL's password never is.
//
// migrate, grants, purge, stats and dead run on several databases too: repeat --database-url,
// or name a --databases-file of URLs (one a line, # starts a comment line), or both (see
// databases.go). Each database is labelled host:port/dbname (package dblist) on its own line
// (stats and dead list: its own block; with --json, one JSON object a line), each runs
// whatever the others did, and the exit status is non-zero when any failed. One database
// prints exactly what it always did. grants runs its statements on the databases it is given
// instead of printing them.
//
//	watermill-inbox purge --window 14d --databases-file tenants.txt
//	watermill-inbox migrate --database-url "$SHARD_1" --database-url "$SHARD_2"
//
// Exit status (see exitCode): 0 on
// success, 1 on an error while running (the database refused, a key is not dead-lettered), 2
// on a usage error (an unknown flag or command, a bad flag value, no database URL, an invalid
// name, a retention window shorter than the declared redelivery window plus margin), 3 when
// purge found another purge of the same table running (nothing was done; try again later), 4
// when layout convert refused the conversion (keys the new layout cannot hold, a source layout
// it does not convert from, <table>_old exists; nothing was changed). On several databases:
// the status of the failures when they all have the same one, else 1; 0 when none failed.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// version is the module version the binary was built from ("(devel)" for a local build).
func version() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "(devel)"
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := rootCmd().ExecuteContext(ctx); err != nil {
		stop()
		os.Exit(exitCode(err))
	}
}

// storeFlags are a store command's database and table: one --database-url (register), or
// several databases (registerMany, the dbs field), and --schema and --table.
type storeFlags struct {
	databaseURL, schema, table string
	dbs                        dbFlags
}

func (f *storeFlags) register(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.databaseURL, "database-url", "", "PostgreSQL URL (default $INBOX_DATABASE_URL, then $DATABASE_URL)")
	f.registerNames(cmd)
}

func (f *storeFlags) registerNames(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.schema, "schema", pgstore.DefaultSchema, "schema of the inbox table")
	cmd.Flags().StringVar(&f.table, "table", pgstore.DefaultTable, "inbox table name")
}

func (f *storeFlags) url() string {
	for _, v := range []string{f.databaseURL, os.Getenv("INBOX_DATABASE_URL"), os.Getenv("DATABASE_URL")} {
		if v != "" {
			return v
		}
	}
	return ""
}

func rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "watermill-inbox",
		Short:         "Operate the watermill-inbox PostgreSQL table",
		SilenceUsage:  true,
		SilenceErrors: false,
		Version:       version(),
	}
	root.AddCommand(migrateCmd())
	root.AddCommand(partitionsCmd())
	root.AddCommand(layoutCmd())
	root.AddCommand(deferredCmd())
	root.AddCommand(purgeCmd())
	root.AddCommand(statsCmd())
	root.AddCommand(deadCmd())
	root.AddCommand(grantsCmd())
	root.AddCommand(sqlCmd())
	guard(root)
	return root
}

func migrateCmd() *cobra.Command {
	var f storeFlags
	var print, withOutbox bool
	var layoutName string
	var outboxTopic string
	var broker brokerFlags
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply the inbox schema migrations, or print them with --print",
		Long: "Applies pending migrations in one transaction under an advisory lock (safe when several\n" +
			"instances run it at once). With --print, writes the SQL script to standard output\n" +
			"without connecting, for teams that run their own migration tool. An existing table\n" +
			"keeps its layout (text or compact, detected); --layout chooses a new table's. With\n" +
			"--broker-topics, also the tables of the postgres broker's topics, for a broker\n" +
			"configured with NoDDL (package adapters/postgres).",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			obCfg := outbox.Config{Schema: f.schema, Topic: outboxTopic}
			if obCfg.Topic == "" {
				obCfg.Topic = outbox.DefaultTopic
			}
			newLayout, err := parseLayout(layoutName)
			if err != nil {
				return err
			}
			layoutSet := cmd.Flags().Changed("layout")
			if print {
				script, err := pgstore.MigrationSQL(pgstore.Config{Schema: f.schema, Table: f.table, Layout: newLayout})
				if err != nil {
					return err
				}
				if _, err = fmt.Fprint(cmd.OutOrStdout(), script); err != nil {
					return err
				}
				if withOutbox {
					obScript, err := outbox.SchemaSQL(obCfg)
					if err != nil {
						return err
					}
					if _, err = fmt.Fprintf(cmd.OutOrStdout(), "\n-- the outbox (topic %s, table %s)\n%s", obCfg.Topic, obCfg.MessagesTable(), obScript); err != nil {
						return err
					}
				}
				return broker.print(cmd)
			}
			if err := broker.validate(); err != nil {
				return err // invalid names, reported before connecting
			}
			if withOutbox {
				if err := obCfg.Validate(); err != nil {
					return err // invalid names, reported before connecting
				}
			}
			if _, err := pgstore.MigrationSQL(pgstore.Config{Schema: f.schema, Table: f.table}); err != nil {
				return err // invalid names, reported before connecting
			}
			mf := migrateFlags{store: &f, layout: newLayout, layoutSet: layoutSet, outbox: withOutbox, outboxCfg: obCfg, broker: &broker}
			return f.each(cmd, pgstore.Config{}, oneLine, mf.migrate)
		},
	}
	f.registerMany(cmd)
	broker.register(cmd)
	cmd.Flags().BoolVar(&print, "print", false, "print the SQL script instead of applying it")
	cmd.Flags().StringVar(&layoutName, "layout", "text", "layout of a new table: text or compact (an existing table keeps its own; see `layout convert`)")
	cmd.Flags().BoolVar(&withOutbox, "outbox", false, "also create the outbox tables (package middleware/outbox) in the same schema")
	cmd.Flags().StringVar(&outboxTopic, "outbox-topic", "", "the outbox topic (default "+outbox.DefaultTopic+")")
	return cmd
}

// migrateFlags are what `migrate` applies on each database.
type migrateFlags struct {
	store     *storeFlags
	layout    pgstore.Layout // a new table's
	layoutSet bool           // --layout was given: an existing table in another layout is refused
	outbox    bool
	outboxCfg outbox.Config
	broker    *brokerFlags
}

// migrate applies the pending migrations on the database at url (the inbox table in its own
// layout, the outbox tables with --outbox, the broker's topic tables) and prints what it did.
func (m migrateFlags) migrate(cmd *cobra.Command, url string) error {
	if url == "" {
		return usageError{errors.New("no database URL: pass --database-url or set INBOX_DATABASE_URL")}
	}
	pool, err := pgxpool.New(cmd.Context(), url)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer pool.Close()
	// An existing table keeps its own layout (convert it with `layout convert`);
	// --layout chooses a new table's.
	cfg, err := pgstore.DetectLayout(cmd.Context(), pool, pgstore.Config{Schema: m.store.schema, Table: m.store.table, Layout: m.layout})
	switch {
	case errors.Is(err, pgstore.ErrNoTable):
		cfg = pgstore.Config{Schema: m.store.schema, Table: m.store.table, Layout: m.layout}
	case err != nil:
		return fmt.Errorf("connect to %s: %w", redact.ConnString(url), err)
	case m.layoutSet && cfg.Layout != m.layout:
		how := "convert it with `watermill-inbox layout convert --to compact`"
		if cfg.Layout != pgstore.LayoutText {
			how = "a conversion back to the text layout is not built; drop --layout to migrate it as it is"
		}
		return usageError{fmt.Errorf("table %s exists in the %s layout, not %s: %s", pgx.Identifier{m.store.schema, m.store.table}.Sanitize(), cfg.Layout, m.layout, how)}
	}
	store, err := pgstore.New(pool, cfg)
	if err != nil {
		return err
	}
	applied, err := store.Migrate(cmd.Context())
	if err != nil {
		return err
	}
	if len(applied) == 0 {
		fmt.Fprintf(cmd.OutOrStdout(), "%s is up to date\n", store.Table())
	} else {
		fmt.Fprintf(cmd.OutOrStdout(), "%s: applied migrations %v\n", store.Table(), applied)
	}
	if m.outbox {
		if err := outbox.InitializeSchema(cmd.Context(), pool, m.outboxCfg); err != nil {
			return err
		}
		fmt.Fprintf(cmd.OutOrStdout(), "outbox tables of topic %q are in place\n", m.outboxCfg.Topic)
	}
	return m.broker.migrate(cmd, pool)
}
