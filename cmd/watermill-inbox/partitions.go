package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// partitionsCmd is `watermill-inbox partitions list|ensure|drop`, the operator's view of a
// partitioned inbox table (pgstore.Config.Partitioning). Exit status 0 on success, 2 on a
// usage error (bad flags, no database URL, an unreadable URL), 1 on any other error (the
// database unreachable, a table that is not partitioned), printed to standard error.
func partitionsCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "partitions",
		Short: "List, create ahead, or drop the partitions of a partitioned inbox table",
		Long: "Works on an inbox table in partitioned mode (range partitions on the producer time,\n" +
			"named <table>_pYYYYMMDD or <table>_pYYYYMMDDHH). Maintenance takes an advisory lock, so it\n" +
			"is safe beside a running PartitionManager. ensure and drop need the table's owner (run\n" +
			"them from cron with the owner's URL); list only reads. See docs/retention.md.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return usageError{errors.New("name a subcommand: list, ensure or drop")}
		},
	}
	cmd.AddCommand(partitionsListCmd(), partitionsEnsureCmd(), partitionsDropCmd())
	return cmd
}

// partitionFlags are the connection and table flags of every partitions subcommand.
type partitionFlags struct {
	storeFlags
	interval string
}

func (f *partitionFlags) register(cmd *cobra.Command) {
	f.storeFlags.register(cmd)
	cmd.Flags().StringVar(&f.interval, "interval", "daily", "partition interval of the table: daily or hourly")
}

// open validates the flags, connects and returns a store on a partitioned table; close the
// pool when done. Errors never contain the URL's password.
func (f *partitionFlags) open(ctx context.Context) (*pgstore.Store, *pgxpool.Pool, error) {
	var interval pgstore.PartitionInterval
	switch f.interval {
	case "daily":
		interval = pgstore.PartitionDaily
	case "hourly":
		interval = pgstore.PartitionHourly
	default:
		return nil, nil, usageError{fmt.Errorf("--interval %q: want daily or hourly", f.interval)}
	}
	cfg := pgstore.Config{Schema: f.schema, Table: f.table,
		// Maintenance claims nothing: the producer-time source does not matter here.
		Partitioning: &pgstore.Partitioning{Interval: interval, ProducerTime: pgstore.ProducerTimeFromKey}}
	if _, err := pgstore.MigrationSQL(cfg); err != nil {
		return nil, nil, err // invalid names, reported before connecting
	}
	raw := f.url()
	if raw == "" {
		return nil, nil, usageError{errors.New("no database URL: pass --database-url or set INBOX_DATABASE_URL")}
	}
	pcfg, err := pgxpool.ParseConfig(raw)
	if err != nil {
		return nil, nil, usageError{fmt.Errorf("database URL %s: not a valid PostgreSQL URL", redact.ConnString(raw))}
	}
	pcfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to %s: %w", redact.ConnString(raw), err)
	}
	// The layout (text or compact) decides how DropPartitions matches a partition's keys to
	// their dead-lettered attempt records; a table that is missing is reported below.
	if detected, err := pgstore.DetectLayout(ctx, pool, cfg); err == nil {
		cfg.Layout = detected.Layout
	}
	s, err := pgstore.New(pool, cfg)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	var kind *string
	if err := pool.QueryRow(ctx, "SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)", s.Table()).Scan(&kind); err != nil {
		pool.Close()
		return nil, nil, fmt.Errorf("connect to %s: look up %s: %w", redact.ConnString(raw), s.Table(), err)
	}
	switch {
	case kind == nil:
		pool.Close()
		return nil, nil, fmt.Errorf("table %s does not exist (create it from Go with a partitioned pgstore.Config and Store.Migrate)", s.Table())
	case *kind != "p":
		pool.Close()
		return nil, nil, fmt.Errorf("table %s is not partitioned (convert it with pgstore.LayoutMigrationSQL; see docs/retention.md)", s.Table())
	}
	return s, pool, nil
}

// parseAge reads a duration: Go's syntax (36h, 90m) or whole days ("14d").
func parseAge(flag, v string) (time.Duration, error) {
	if d, ok := strings.CutSuffix(v, "d"); ok {
		n, err := strconv.Atoi(d)
		if err == nil && n >= 0 && n <= 100*365 {
			return time.Duration(n) * 24 * time.Hour, nil
		}
	} else if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		return d, nil
	}
	return 0, usageError{fmt.Errorf("--%s %q: want a duration such as 14d, 36h or 90m", flag, v)}
}

func printPartitions(cmd *cobra.Command, parts []pgstore.Partition) {
	w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "PARTITION\tFROM (UTC)\tTO (UTC)\tROWS (EST.)\tBYTES\tSTATE")
	for _, p := range parts {
		from, to, state := "-", "-", "attached"
		if !p.From.IsZero() {
			from, to = p.From.Format(time.RFC3339), p.To.Format(time.RFC3339)
		} else {
			state = "not named by watermill-inbox (never dropped)"
		}
		if p.DetachPending {
			state = "detach pending (drop finishes it)"
		}
		rows := strconv.FormatInt(p.Rows, 10)
		if p.Rows < 0 {
			rows = "never analysed"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%d\t%s\n", p.Name, from, to, rows, p.Bytes, state)
	}
	_ = w.Flush()
}

func partitionsListCmd() *cobra.Command {
	var f partitionFlags
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List the partitions, oldest first, with their producer-time range, estimated rows and bytes",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			s, pool, err := f.open(cmd.Context())
			if err != nil {
				return err
			}
			defer pool.Close()
			parts, err := s.Partitions(cmd.Context())
			if err != nil {
				return err
			}
			printPartitions(cmd, parts)
			return nil
		},
	}
	f.register(cmd)
	return cmd
}

func partitionsEnsureCmd() *cobra.Command {
	var f partitionFlags
	var lead, back string
	cmd := &cobra.Command{
		Use:   "ensure",
		Short: "Create the missing partitions from now minus --back to now plus --lead",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			l, err := parseAge("lead", lead)
			if err != nil {
				return err
			}
			b, err := parseAge("back", back)
			if err != nil {
				return err
			}
			s, pool, err := f.open(cmd.Context())
			if err != nil {
				return err
			}
			defer pool.Close()
			now := time.Now()
			created, err := s.EnsurePartitions(cmd.Context(), now.Add(-b), now.Add(l))
			for _, name := range created {
				fmt.Fprintf(cmd.OutOrStdout(), "created %s\n", name)
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: %d partitions created; every period from %s to %s has one\n",
				s.Table(), len(created), now.Add(-b).UTC().Format(time.RFC3339), now.Add(l).UTC().Format(time.RFC3339))
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().StringVar(&lead, "lead", "48h", "create partitions this far ahead of now (cover producers' clock skew and maintenance downtime)")
	cmd.Flags().StringVar(&back, "back", "0h", "also create partitions this far back (the retention window, for late copies)")
	return cmd
}

func partitionsDropCmd() *cobra.Command {
	var f partitionFlags
	var olderThan string
	var dryRun bool
	cmd := &cobra.Command{
		Use:   "drop --older-than D",
		Short: "Detach (CONCURRENTLY) and drop the partitions whose whole range ended more than D ago",
		Long: "Dropping a partition forgets that its messages were processed: a copy arriving later is\n" +
			"processed again. D must be at least the retention window (longer than the longest\n" +
			"redelivery, dead-letter replay or offset reset you support, plus a margin). --dry-run lists\n" +
			"what would be dropped and changes nothing.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if olderThan == "" {
				return usageError{errors.New("--older-than is required (the retention window, e.g. 14d)")}
			}
			d, err := parseAge("older-than", olderThan)
			if err != nil {
				return err
			}
			if d < time.Hour {
				return usageError{fmt.Errorf("--older-than %s: refusing less than 1h; it must be at least the retention window", olderThan)}
			}
			s, pool, err := f.open(cmd.Context())
			if err != nil {
				return err
			}
			defer pool.Close()
			cutoff := time.Now().Add(-d)
			if dryRun {
				parts, err := s.Partitions(cmd.Context())
				if err != nil {
					return err
				}
				var gone []pgstore.Partition
				for _, p := range parts {
					if !p.To.IsZero() && !p.To.After(cutoff) {
						gone = append(gone, p)
					}
				}
				fmt.Fprintf(cmd.OutOrStdout(), "dry run: %d partitions ended before %s and would be dropped:\n", len(gone), cutoff.UTC().Format(time.RFC3339))
				printPartitions(cmd, gone)
				return nil
			}
			dropped, err := s.DropPartitions(cmd.Context(), cutoff)
			for _, name := range dropped {
				fmt.Fprintf(cmd.OutOrStdout(), "dropped %s\n", name)
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: %d partitions dropped (every partition that ended before %s)\n", s.Table(), len(dropped), cutoff.UTC().Format(time.RFC3339))
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().StringVar(&olderThan, "older-than", "", "drop partitions whose range ended more than this long ago (required; e.g. 14d)")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "list what would be dropped; change nothing")
	return cmd
}
