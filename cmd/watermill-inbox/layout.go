package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// refusedError marks a conversion that `layout convert` will not run as asked, with nothing
// changed: exit status 4.
type refusedError struct{ err error }

func (e refusedError) Error() string { return e.err.Error() }
func (e refusedError) Unwrap() error { return e.err }

// parseLayout reads --layout and --to: "text" or "compact". A bad value is a usage error.
func parseLayout(name string) (pgstore.Layout, error) {
	switch name {
	case "text":
		return pgstore.LayoutText, nil
	case "compact":
		return pgstore.LayoutCompact, nil
	}
	return 0, usageError{fmt.Errorf("layout %q: want text or compact", name)}
}

// describeLayout names cfg's layout and mode for the operator, e.g. "compact, partitioned daily".
func describeLayout(cfg pgstore.Config) string {
	d := cfg.Layout.String()
	if p := cfg.Partitioning; p != nil {
		d += ", partitioned " + p.Interval.String()
	}
	return d
}

// layoutCmd is `watermill-inbox layout show|convert`.
func layoutCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "layout",
		Short: "Show the inbox table's layout, or convert the table to another",
		Long: "The inbox table's layout (text or compact, partitioned or not; docs/retention.md,\n" +
			"\"Storage per row\"). show reads it from the catalog; convert rewrites the table.",
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return usageError{errors.New("name a subcommand: show or convert")}
		},
	}
	cmd.AddCommand(layoutShowCmd(), layoutConvertCmd())
	return cmd
}

// openPool validates the store flags, then opens a small pool and pings it. Errors never hold
// the URL's password.
func (f *storeFlags) openPool(ctx context.Context) (*pgxpool.Pool, error) {
	if _, err := pgstore.MigrationSQL(pgstore.Config{Schema: f.schema, Table: f.table}); err != nil {
		return nil, usageError{err} // invalid names, reported before connecting
	}
	raw := f.url()
	if raw == "" {
		return nil, usageError{errors.New("no database URL: pass --database-url or set INBOX_DATABASE_URL")}
	}
	pcfg, err := pgxpool.ParseConfig(raw)
	if err != nil {
		return nil, usageError{fmt.Errorf("database URL %s: not a valid PostgreSQL URL", redact.ConnString(raw))}
	}
	pcfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", redact.ConnString(raw), err)
	}
	pctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect to %s: %w", redact.ConnString(raw), err)
	}
	return pool, nil
}

func layoutShowCmd() *cobra.Command {
	var f storeFlags
	cmd := &cobra.Command{
		Use:   "show",
		Short: "Print the inbox table's layout (text or compact; partitioned daily or hourly)",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			pool, err := f.openPool(cmd.Context())
			if err != nil {
				return err
			}
			defer pool.Close()
			cfg, err := pgstore.DetectLayout(cmd.Context(), pool, pgstore.Config{Schema: f.schema, Table: f.table})
			if err != nil {
				return err
			}
			_, err = fmt.Fprintf(cmd.OutOrStdout(), "%s: %s\n", pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize(), describeLayout(cfg))
			return err
		},
	}
	f.register(cmd)
	return cmd
}

func layoutConvertCmd() *cobra.Command {
	var f storeFlags
	var toName, partitioned string
	var print, dryRun bool
	var lockTimeout time.Duration
	cmd := &cobra.Command{
		Use:   "convert --to compact",
		Short: "Convert the inbox table to another layout, in place, in one transaction",
		Long: "Converts a text-layout inbox table (not partitioned) to the compact layout (--to compact),\n" +
			"to partitioned mode by the timestamp of UUIDv7 keys (--partitioned daily|hourly), or both,\n" +
			"with the script of pgstore.LayoutMigrationSQL: one transaction that locks the table\n" +
			"(claims wait until it commits), refuses a table holding a key the new layout cannot hold,\n" +
			"renames the table to <table>_old, creates the new one and copies every row. <table>_old\n" +
			"is kept for you to compare and drop. Stop the consumers first, or let their claims fail\n" +
			"until they run with the new pgstore.Config.\n\n" +
			"--print writes the script and does not connect; --dry-run connects, reads what the\n" +
			"conversion would do (rows, refused keys, partitions) and changes nothing. Exit status:\n" +
			"0 converted, or nothing to do, or a dry run that would succeed; 1 an error while running\n" +
			"(nothing changed unless it says so); 2 a usage error; 4 refused, nothing changed (keys the\n" +
			"new layout cannot hold, a source layout it does not convert from, <table>_old exists).",
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if toName == "" {
				return usageError{errors.New("--to is required: compact or text")}
			}
			layout, err := parseLayout(toName)
			if err != nil {
				return err
			}
			to := pgstore.Config{Schema: f.schema, Table: f.table, Layout: layout}
			switch partitioned {
			case "", "none":
			case "daily", "hourly":
				interval := pgstore.PartitionDaily
				if partitioned == "hourly" {
					interval = pgstore.PartitionHourly
				}
				to.Partitioning = &pgstore.Partitioning{Interval: interval, ProducerTime: pgstore.ProducerTimeFromKey}
			default:
				return usageError{fmt.Errorf("--partitioned %q: want none, daily or hourly", partitioned)}
			}
			if lockTimeout < 0 {
				return usageError{errors.New("--lock-timeout must not be negative")}
			}
			// The one source the script converts from: the text layout, not partitioned.
			from := pgstore.Config{Schema: f.schema, Table: f.table}
			out := cmd.OutOrStdout()
			if print {
				script, err := pgstore.LayoutMigrationSQL(from, to)
				if err != nil {
					return err // inbox.ErrInvalidConfig: a usage error
				}
				_, err = fmt.Fprint(out, script)
				return err
			}
			pool, err := f.openPool(cmd.Context())
			if err != nil {
				return err
			}
			defer pool.Close()
			return convertLayout(cmd.Context(), out, pool, from, to, dryRun, lockTimeout)
		},
	}
	f.register(cmd)
	fl := cmd.Flags()
	fl.StringVar(&toName, "to", "", "the layout to convert to: compact or text (required)")
	fl.StringVar(&partitioned, "partitioned", "none", "also partition by the timestamp of UUIDv7 keys: none, daily or hourly")
	fl.BoolVar(&print, "print", false, "print the conversion script; do not connect")
	fl.BoolVar(&dryRun, "dry-run", false, "report what the conversion would do; change nothing")
	fl.DurationVar(&lockTimeout, "lock-timeout", 10*time.Second, "give up (nothing changed) when the table's lock is not granted within this; 0 waits as long as it takes")
	return cmd
}

// convertLayout detects the table's layout, checks the conversion reading only, and unless
// dryRun runs it on one connection, then verifies the result with Migrate (which also creates
// the partitions claims need right away).
func convertLayout(ctx context.Context, out io.Writer, pool *pgxpool.Pool, from, to pgstore.Config, dryRun bool, lockTimeout time.Duration) error {
	check, same, err := checkLayoutConversion(ctx, out, pool, from, to)
	switch {
	case err != nil:
		return err
	case same:
		_, err := fmt.Fprintln(out, "nothing to do: the table already has that layout")
		return err
	case dryRun:
		_, err := fmt.Fprintln(out, "dry run: the conversion would succeed; nothing changed")
		return err
	}
	took, err := runLayoutScript(ctx, pool, from, to, lockTimeout)
	if err != nil {
		return err
	}
	return verifyConversion(ctx, out, pool, to, check, took)
}

// checkLayoutConversion reads, in a READ ONLY transaction, the table's layout and what the
// conversion from it to to would do, and prints both. same reports that the table already
// has to's layout (nothing to check). It returns a refusedError when the conversion must not
// run: a source other than the text layout unpartitioned, keys the new layout cannot hold, or
// an existing <table>_old.
func checkLayoutConversion(ctx context.Context, out io.Writer, pool *pgxpool.Pool, from, to pgstore.Config) (check pgstore.ConversionCheck, same bool, err error) {
	err = pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		have, err := pgstore.DetectLayout(ctx, tx, from)
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "table %s: %s; converting to %s\n", pgx.Identifier{have.Schema, have.Table}.Sanitize(), describeLayout(have), describeLayout(to))
		if sameLayout(have, to) {
			same = true
			return nil
		}
		if have.Layout != pgstore.LayoutText || have.Partitioning != nil {
			return refusedError{fmt.Errorf("layout convert converts only from the text layout, not partitioned; this table is %s (nothing changed)", describeLayout(have))}
		}
		if check, err = pgstore.CheckConversion(ctx, tx, from, to); err != nil {
			return err
		}
		fmt.Fprintf(out, "rows to copy %d; keys the new layout cannot hold %d", check.Rows, check.Unconvertible)
		if to.Partitioning != nil {
			fmt.Fprintf(out, "; partitions to create %d", check.Periods)
		}
		fmt.Fprintln(out)
		return refuseConversion(check, to)
	})
	return check, same, err
}

// sameLayout reports whether have and to name the same layout and partitioning interval.
func sameLayout(have, to pgstore.Config) bool {
	return have.Layout == to.Layout && (have.Partitioning == nil) == (to.Partitioning == nil) &&
		(have.Partitioning == nil || have.Partitioning.Interval == to.Partitioning.Interval)
}

// refuseConversion returns a refusedError when check found keys to's layout cannot hold or an
// existing <table>_old, and nil otherwise.
func refuseConversion(check pgstore.ConversionCheck, to pgstore.Config) error {
	switch {
	case check.Unconvertible > 0:
		what := "a canonical lowercase UUID"
		if to.Partitioning != nil {
			what = "a canonical lowercase UUIDv7"
		}
		return refusedError{fmt.Errorf("%d rows have a message_id that is not %s: the %s layout cannot hold them (nothing changed)", check.Unconvertible, what, describeLayout(to))}
	case check.OldTableExists:
		return refusedError{fmt.Errorf("%s exists (an earlier conversion's old rows?): drop or rename it first (nothing changed)", check.OldTable)}
	}
	return nil
}

// runLayoutScript runs pgstore.LayoutMigrationSQL(from, to) on one connection with
// lock_timeout set to lockTimeout, and returns how long it took. A failure rolls the script's
// one transaction back; a refusal raised by the script (SQLSTATE P0001) is a refusedError.
func runLayoutScript(ctx context.Context, pool *pgxpool.Pool, from, to pgstore.Config, lockTimeout time.Duration) (time.Duration, error) {
	script, err := pgstore.LayoutMigrationSQL(from, to)
	if err != nil {
		return 0, err
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return 0, fmt.Errorf("convert: %w", err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "SELECT set_config('lock_timeout', $1, false)", fmt.Sprint(lockTimeout.Milliseconds())); err != nil {
		return 0, fmt.Errorf("convert: set lock_timeout: %w", err)
	}
	start := time.Now()
	if _, err := conn.Exec(ctx, script); err != nil {
		// The script is one transaction: a failed statement leaves it aborted, and the
		// rollback undoes everything it did.
		_, _ = conn.Exec(context.WithoutCancel(ctx), "ROLLBACK")
		var pgErr *pgconn.PgError
		switch {
		case errors.As(err, &pgErr) && pgErr.Code == "55P03":
			return 0, fmt.Errorf("convert: the table's lock was not granted within --lock-timeout %s (transactions are using it; nothing changed): %w", lockTimeout, err)
		case errors.As(err, &pgErr) && pgErr.Code == "P0001":
			return 0, refusedError{fmt.Errorf("convert: refused (nothing changed): %w", err)}
		}
		return 0, fmt.Errorf("convert (rolled back, nothing changed): %w", err)
	}
	return time.Since(start), nil
}

// verifyConversion checks the converted table with Migrate, compares its rows with
// <table>_old's and prints the result and the next step.
func verifyConversion(ctx context.Context, out io.Writer, pool *pgxpool.Pool, to pgstore.Config, check pgstore.ConversionCheck, took time.Duration) error {
	store, err := pgstore.New(pool, to)
	if err != nil {
		return err
	}
	if _, err := store.Migrate(ctx); err != nil {
		return fmt.Errorf("converted, but the check of the new table failed: %w", err)
	}
	var rows, oldRows int64
	if err := pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+store.Table()+"), (SELECT count(*) FROM "+check.OldTable+")").Scan(&rows, &oldRows); err != nil {
		return fmt.Errorf("converted; counting the rows: %w", err)
	}
	fmt.Fprintf(out, "converted in %s: %d rows in %s, %d kept in %s\n", took.Round(time.Millisecond), rows, store.Table(), oldRows, check.OldTable)
	fmt.Fprintf(out, "next: run the consumers with the new pgstore.Config (%s); check the rows, then DROP TABLE %s\n", describeLayout(to), check.OldTable)
	if rows < oldRows {
		return fmt.Errorf("converted, but %s holds %d rows and %s %d: check before dropping anything", store.Table(), rows, check.OldTable, oldRows)
	}
	return nil
}
