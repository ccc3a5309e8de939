package main

import (
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
)

// deferredCmd operates the store-then-process inbox table (package middleware/deferred):
//
//	watermill-inbox deferred migrate [--print]
//	watermill-inbox deferred replay --consumer billing --key pay-1 --key pay-2
//	watermill-inbox deferred replay --consumer billing --status dead
//	watermill-inbox deferred replay --consumer billing --from 2026-11-30T00:00:00Z --to 2026-12-01T00:00:00Z --status done
//	watermill-inbox deferred stats --consumer billing [--stuck-after 5m] [--sequence-field seq]
//	watermill-inbox deferred purge --consumer billing --window 14d [--dry-run]
func deferredCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "deferred",
		Short: "Operate the store-then-process inbox table (migrate, replay, stats, purge)",
	}
	cmd.AddCommand(deferredMigrateCmd(), deferredReplayCmd(), deferredStatsCmd(), deferredPurgeCmd())
	return cmd
}

type deferredFlags struct {
	storeFlags
	consumer string
}

func (f *deferredFlags) register(cmd *cobra.Command, consumer bool) {
	cmd.Flags().StringVar(&f.databaseURL, "database-url", "", "PostgreSQL URL (default $INBOX_DATABASE_URL, then $DATABASE_URL)")
	cmd.Flags().StringVar(&f.schema, "schema", deferred.DefaultSchema, "schema of the table")
	cmd.Flags().StringVar(&f.table, "table", deferred.DefaultTable, "store-then-process table name")
	if consumer {
		cmd.Flags().StringVar(&f.consumer, "consumer", "", "consumer name (required)")
	}
}

// open validates the names, connects and returns the inbox of the consumer ("migrate" when
// none is needed) and the pool to close.
func (f *deferredFlags) open(cmd *cobra.Command) (*deferred.Inbox, *pgxpool.Pool, error) {
	return f.openWith(cmd, deferred.Config{})
}

// openWith is open with cfg's other settings (a retention window). Invalid names or settings
// and a missing URL are usage errors, reported before connecting.
func (f *deferredFlags) openWith(cmd *cobra.Command, cfg deferred.Config) (*deferred.Inbox, *pgxpool.Pool, error) {
	consumer := f.consumer
	if consumer == "" {
		consumer = "migrate"
	}
	cfg.Schema, cfg.Table, cfg.ConsumerName = f.schema, f.table, consumer
	if _, err := deferred.MigrationSQL(cfg); err != nil {
		return nil, nil, usageError{err} // invalid names or settings, reported before connecting
	}
	url := f.url()
	if url == "" {
		return nil, nil, usageError{errors.New("no database URL: pass --database-url or set INBOX_DATABASE_URL")}
	}
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, nil, usageError{fmt.Errorf("database URL: %w", err)} // pgx redacts the password
	}
	pool, err := pgxpool.NewWithConfig(cmd.Context(), pcfg)
	if err != nil {
		return nil, nil, fmt.Errorf("connect: %w", err)
	}
	cfg.Pool = pool
	ib, err := deferred.New(cfg, nil)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return ib, pool, nil
}

func deferredMigrateCmd() *cobra.Command {
	var f deferredFlags
	var print bool
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply the store-then-process table's migrations, or print them with --print",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if print {
				script, err := deferred.MigrationSQL(deferred.Config{Schema: f.schema, Table: f.table})
				if err != nil {
					return err
				}
				_, err = fmt.Fprint(cmd.OutOrStdout(), script)
				return err
			}
			ib, pool, err := f.open(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			applied, err := ib.Migrate(cmd.Context())
			if err != nil {
				return err
			}
			if len(applied) == 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "%s is up to date\n", ib.Table())
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "%s: applied migrations %v\n", ib.Table(), applied)
			}
			return nil
		},
	}
	f.register(cmd, false)
	cmd.Flags().BoolVar(&print, "print", false, "print the SQL script instead of applying it")
	return cmd
}

func deferredReplayCmd() *cobra.Command {
	var f deferredFlags
	var keys, statuses []string
	var from, to string
	var all bool
	cmd := &cobra.Command{
		Use:   "replay",
		Short: "Reset done and dead rows of a consumer to pending, so the workers handle them again",
		Long: "Selects rows of --consumer by --key (repeatable), by received time (--from, --to, RFC 3339,\n" +
			"[from, to)) and by --status (done, dead; repeatable; default both). At least one selector,\n" +
			"or --all, is required. Pending and processing rows are never touched. Prints the number\n" +
			"of rows reset.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if f.consumer == "" {
				return fmt.Errorf("--consumer is required")
			}
			var p deferred.ReplayParams
			p.Keys = keys
			for _, s := range statuses {
				p.Statuses = append(p.Statuses, deferred.Status(s))
			}
			for _, tf := range []struct {
				flag, v string
				dst     *time.Time
			}{{"--from", from, &p.From}, {"--to", to, &p.To}} {
				if tf.v == "" {
					continue
				}
				ts, err := time.Parse(time.RFC3339, tf.v)
				if err != nil {
					return fmt.Errorf("%s: %w", tf.flag, err)
				}
				*tf.dst = ts
			}
			if !all && len(p.Keys) == 0 && len(p.Statuses) == 0 && p.From.IsZero() && p.To.IsZero() {
				return fmt.Errorf("name the rows to replay (--key, --from/--to, --status), or pass --all")
			}
			ib, pool, err := f.open(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			n, err := ib.Replay(cmd.Context(), p)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%d rows of consumer %q reset to pending\n", n, f.consumer)
			return nil
		},
	}
	f.register(cmd, true)
	cmd.Flags().StringArrayVar(&keys, "key", nil, "message key to replay (repeatable)")
	cmd.Flags().StringArrayVar(&statuses, "status", nil, "status to replay: done or dead (repeatable; default both)")
	cmd.Flags().StringVar(&from, "from", "", "replay rows received at or after this time (RFC 3339)")
	cmd.Flags().StringVar(&to, "to", "", "replay rows received before this time (RFC 3339)")
	cmd.Flags().BoolVar(&all, "all", false, "replay every done and dead row of the consumer")
	return cmd
}

func deferredStatsCmd() *cobra.Command {
	var f deferredFlags
	var cfg deferred.Config
	var continueAfterDead bool
	cmd := &cobra.Command{
		Use:   "stats",
		Short: "Print a consumer's pending, processing and dead rows, the oldest pending age and the stuck aggregates",
		Long: "Prints the consumer's pending rows and the oldest one's age, the rows in processing, the dead\n" +
			"rows, and the aggregates whose head (the first unfinished row in the aggregate's order) has\n" +
			"waited longer than --stuck-after: pending (a gap in producer sequences, a failing row, workers\n" +
			"behind), or dead and holding pending rows. Pass the consumer's ordering: --sequence-field when\n" +
			"it orders by producer sequence, --continue-after-dead when a dead row does not hold its\n" +
			"aggregate.",
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if f.consumer == "" {
				return usageError{fmt.Errorf("--consumer is required")}
			}
			if cfg.SequenceField != "" {
				cfg.Ordering = deferred.OrderProducerSequence
			}
			if continueAfterDead {
				cfg.AfterDead = deferred.ContinueAggregate
			}
			if cfg.StuckAfter <= 0 {
				return usageError{fmt.Errorf("--stuck-after must be positive")}
			}
			ib, pool, err := f.openWith(cmd, cfg)
			if err != nil {
				return err
			}
			defer pool.Close()
			st, err := ib.Stats(cmd.Context())
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "pending %d (oldest %s)\nprocessing %d\ndead %d\nstuck aggregates %d (head waiting over %s)\n",
				st.Pending, st.OldestPendingAge.Round(time.Millisecond), st.Processing, st.Dead, st.StuckAggregates, cfg.StuckAfter)
			return nil
		},
	}
	f.register(cmd, true)
	cmd.Flags().DurationVar(&cfg.StuckAfter, "stuck-after", deferred.DefaultStuckAfter, "count an aggregate as stuck when its head has waited longer than this")
	cmd.Flags().StringVar(&cfg.SequenceField, "sequence-field", "", "the consumer orders by the producer sequence in this metadata field (OrderProducerSequence)")
	cmd.Flags().BoolVar(&continueAfterDead, "continue-after-dead", false, "the consumer's dead rows do not hold their aggregate (ContinueAggregate)")
	return cmd
}

func deferredPurgeCmd() *cobra.Command {
	var f deferredFlags
	var pf purgeFlags
	cmd := &cobra.Command{
		Use:   "purge --consumer billing --window 14d",
		Short: "Delete a consumer's done rows that have left the retention window, in bounded batches",
		Long: "Deletes, in batches of --batch-size rows per transaction with --pause between batches,\n" +
			"the done rows of --consumer whose done_at is older than --window, and the rows of each\n" +
			"--topic (watermill-sql) that every consumer group has consumed and that are older than\n" +
			"--window. Pending, processing and dead rows are never deleted; with producer sequences the\n" +
			"done rows the ordering still reads are kept. The window is refused when it is shorter than\n" +
			"--max-redelivery plus --margin. One purge runs at a time per table and consumer: a second\n" +
			"one exits with status 3. --dry-run prints what would be deleted and changes nothing. See\n" +
			"docs/retention.md.",
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if f.consumer == "" {
				return usageError{fmt.Errorf("--consumer is required")}
			}
			if err := pf.check(); err != nil {
				return err
			}
			ib, pool, err := f.openWith(cmd, deferred.Config{Retention: pf.r})
			if err != nil {
				return err
			}
			defer pool.Close()
			return pf.run(cmd, ib, ib.PurgeExpired)
		},
	}
	f.register(cmd, true)
	pf.register(cmd, "done rows")
	return cmd
}
