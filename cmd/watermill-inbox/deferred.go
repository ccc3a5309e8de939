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
//	watermill-inbox deferred stats --consumer billing
func deferredCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "deferred",
		Short: "Operate the store-then-process inbox table (migrate, replay, stats)",
	}
	cmd.AddCommand(deferredMigrateCmd(), deferredReplayCmd(), deferredStatsCmd())
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
	consumer := f.consumer
	if consumer == "" {
		consumer = "migrate"
	}
	cfg := deferred.Config{Schema: f.schema, Table: f.table, ConsumerName: consumer}
	if _, err := deferred.MigrationSQL(cfg); err != nil {
		return nil, nil, err // invalid names, reported before connecting
	}
	url := f.url()
	if url == "" {
		return nil, nil, usageError{errors.New("no database URL: pass --database-url or set INBOX_DATABASE_URL")}
	}
	pool, err := pgxpool.New(cmd.Context(), url)
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
	cmd := &cobra.Command{
		Use:   "stats",
		Short: "Print a consumer's pending, processing and dead rows and the oldest pending age",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if f.consumer == "" {
				return fmt.Errorf("--consumer is required")
			}
			ib, pool, err := f.open(cmd)
			if err != nil {
				return err
			}
			defer pool.Close()
			st, err := ib.Stats(cmd.Context())
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "pending %d (oldest %s)\nprocessing %d\ndead %d\n",
				st.Pending, st.OldestPendingAge.Round(time.Millisecond), st.Processing, st.Dead)
			return nil
		},
	}
	f.register(cmd, true)
	return cmd
}
