package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// days is a duration flag that also accepts days ("14d", "1.5d") beside Go durations ("36h").
type days struct{ d *time.Duration }

func (v days) String() string {
	if v.d == nil || *v.d == 0 {
		return ""
	}
	if *v.d%(24*time.Hour) == 0 {
		return strconv.FormatInt(int64(*v.d/(24*time.Hour)), 10) + "d"
	}
	return v.d.String()
}

func (v days) Set(s string) error {
	if n, ok := strings.CutSuffix(s, "d"); ok {
		f, err := strconv.ParseFloat(n, 64)
		if err != nil || f < 0 {
			return fmt.Errorf("want a duration such as 14d or 36h, got %q", s)
		}
		*v.d = time.Duration(f * float64(24*time.Hour))
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return fmt.Errorf("want a duration such as 14d or 36h, got %q", s)
	}
	*v.d = d
	return nil
}

func (days) Type() string { return "duration" }

// check returns cfg with the flags' schema and table, or a usage error for invalid names or
// an invalid retention window.
func (f *storeFlags) check(cfg pgstore.Config) (pgstore.Config, error) {
	cfg.Schema, cfg.Table = f.schema, f.table
	if _, err := pgstore.MigrationSQL(cfg); err != nil {
		return cfg, usageError{err}
	}
	if cfg.Retention != (inbox.Retention{}) {
		if err := cfg.Retention.Validate(); err != nil {
			return cfg, usageError{err}
		}
	}
	return cfg, nil
}

// connect validates the store configuration (check), then opens a small pool on url, pings
// it and reads the existing table's layout (pgstore.DetectLayout), which it sets in the
// store's Config. Invalid names or windows and a missing URL are usage errors, reported
// before connecting.
func (f *storeFlags) connect(ctx context.Context, url string, cfg pgstore.Config) (*pgstore.Store, *pgxpool.Pool, error) {
	cfg, err := f.check(cfg)
	if err != nil {
		return nil, nil, err
	}
	if url == "" {
		return nil, nil, usageError{fmt.Errorf("no database URL: pass --database-url or set INBOX_DATABASE_URL")}
	}
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, nil, usageError{fmt.Errorf("database URL: %w", err)} // pgx redacts the password
	}
	pcfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, nil, fmt.Errorf("connect: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, nil, fmt.Errorf("connect: %w", err)
	}
	// The table's own layout (text or compact, partitioned or not), so purge and stats
	// read the columns it has. A missing table keeps cfg: the command reports it.
	if detected, err := pgstore.DetectLayout(pctx, pool, cfg); err == nil {
		cfg = detected
	} else if !errors.Is(err, pgstore.ErrNoTable) {
		pool.Close()
		return nil, nil, err
	}
	store, err := pgstore.New(pool, cfg)
	if err != nil {
		pool.Close()
		return nil, nil, usageError{err}
	}
	return store, pool, nil
}

func purgeCmd() *cobra.Command {
	var f storeFlags
	var pf purgeFlags
	cmd := &cobra.Command{
		Use:   "purge --window 14d",
		Short: "Delete rows that have left the retention window, in bounded batches",
		Long: "Deletes, in batches of --batch-size rows per transaction with --pause between batches:\n" +
			"processed rows older than --window, attempt records of unsettled messages older than\n" +
			"--window (never one a delivery holds), dead-lettered records older than\n" +
			"--dead-letter-window, and the rows of each --topic (watermill-sql) that every consumer\n" +
			"group has consumed and that are older than --window. The window is refused when it is\n" +
			"shorter than --max-redelivery plus --margin. One purge runs at a time per table: a\n" +
			"second one exits with status 3. --dry-run prints what would be deleted and changes\n" +
			"nothing. See docs/retention.md.",
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := pf.check(); err != nil {
				return err
			}
			return f.each(cmd, pgstore.Config{Retention: pf.r}, oneLine, func(cmd *cobra.Command, url string) error {
				store, pool, err := f.connect(cmd.Context(), url, pgstore.Config{Retention: pf.r})
				if err != nil {
					return err
				}
				defer pool.Close()
				return pf.run(cmd, store, store.PurgeExpired)
			})
		},
	}
	f.registerMany(cmd)
	pf.register(cmd, "processed rows")
	cmd.Flags().Var(days{&pf.r.DeadLetterWindow}, "dead-letter-window", "how long dead-lettered records are kept (default 30d, at least --window)")
	return cmd
}

// purgeFlags are the flags and checks purge and deferred purge share.
type purgeFlags struct {
	r           inbox.Retention
	p           pgstore.PurgeExpiredParams
	topics      []string
	topicSchema string
}

// register adds the retention window (of what: "processed rows", "done rows"), the batch, the
// pause, the topics and the dry run.
func (pf *purgeFlags) register(cmd *cobra.Command, what string) {
	fl := cmd.Flags()
	fl.Var(days{&pf.r.Window}, "window", "retention window of "+what+" (required), e.g. 14d or 36h")
	fl.Var(days{&pf.r.MaxRedelivery}, "max-redelivery", "the longest time a copy of a message can still arrive (default 7d)")
	fl.Var(days{&pf.r.Margin}, "margin", "added to --max-redelivery to get the shortest accepted window (default 1d)")
	fl.IntVar(&pf.p.BatchSize, "batch-size", pgstore.DefaultPurgeBatchSize, "rows deleted per transaction")
	fl.DurationVar(&pf.p.Pause, "pause", pgstore.DefaultPurgePause, "pause between batches")
	fl.StringArrayVar(&pf.topics, "topic", nil, "a watermill-sql topic whose consumed rows are purged too (repeatable), e.g. inbox_outbox")
	fl.StringVar(&pf.topicSchema, "topic-schema", "", "schema of the --topic tables (default: the connection's search_path)")
	fl.BoolVar(&pf.p.DryRun, "dry-run", false, "print what would be deleted; delete nothing")
}

// check reports a missing window, a batch size below 1 or an invalid topic as a usage error,
// before anything connects, and adds the topics to the purge's parameters.
func (pf *purgeFlags) check() error {
	if pf.r.Window == 0 {
		return usageError{fmt.Errorf("--window is required: the retention window your consumers are configured with (e.g. 14d)")}
	}
	if pf.p.BatchSize < 1 {
		return usageError{fmt.Errorf("--batch-size must be at least 1")}
	}
	for _, t := range pf.topics {
		wt := pgstore.WatermillTopic{Schema: pf.topicSchema, Topic: t}
		if err := wt.Validate(); err != nil {
			return usageError{err}
		}
		pf.p.Topics = append(pf.p.Topics, wt)
	}
	return nil
}

// run purges with progress lines on standard error and prints the report on standard output
// (also after an error, when the purge got as far as reading the clock).
func (pf *purgeFlags) run(cmd *cobra.Command, store interface {
	Retention() (inbox.Retention, bool)
}, purge func(context.Context, pgstore.PurgeExpiredParams) (pgstore.PurgeReport, error)) error {
	pf.p.Progress = progressPrinter(cmd.ErrOrStderr(), pf.p.DryRun)
	rep, err := purge(cmd.Context(), pf.p)
	if !rep.Now.IsZero() {
		printReport(cmd.OutOrStdout(), store, rep)
	}
	return err
}

// progressPrinter reports a long purge on w: a line per table at most every 2 seconds, and
// when the table is done.
func progressPrinter(w io.Writer, dry bool) func(pgstore.PurgeProgress) {
	last := time.Now()
	return func(pr pgstore.PurgeProgress) {
		if dry || (!pr.Done && time.Since(last) < 2*time.Second) {
			return
		}
		last = time.Now()
		state := "..."
		if pr.Done {
			state = "done"
		}
		fmt.Fprintf(w, "purge %-12s %s: %d rows deleted in %d batches %s\n", pr.Kind, pr.Table, pr.Rows, pr.Batches, state)
	}
}

// printReport prints a purge's report. A report without a dead-letter cutoff (the
// store-then-process table's: dead rows are not purged by age) prints no dead-letter window.
func printReport(w io.Writer, store interface {
	Retention() (inbox.Retention, bool)
}, rep pgstore.PurgeReport) {
	ret, _ := store.Retention()
	verb := "deleted"
	if rep.DryRun {
		verb = "would delete"
	}
	if rep.DeadLetterCutoff.IsZero() {
		fmt.Fprintf(w, "retention window %s; database time %s\n", days{&ret.Window}, rep.Now.UTC().Format(time.RFC3339))
		fmt.Fprintf(w, "cutoff %s\n", rep.Cutoff.UTC().Format(time.RFC3339))
	} else {
		fmt.Fprintf(w, "retention window %s (dead letters %s); database time %s\n", days{&ret.Window}, days{&ret.DeadLetterWindow}, rep.Now.UTC().Format(time.RFC3339))
		fmt.Fprintf(w, "cutoff %s, dead-letter cutoff %s\n", rep.Cutoff.UTC().Format(time.RFC3339), rep.DeadLetterCutoff.UTC().Format(time.RFC3339))
	}
	for _, t := range rep.Tables {
		fmt.Fprintf(w, "%-12s %s: %s %d rows\n", t.Kind, t.Table, verb, t.Rows)
	}
	fmt.Fprintf(w, "total: %s %d rows\n", verb, rep.Rows())
}
