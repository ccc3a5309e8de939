package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"sort"
	"time"

	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

func statsCmd() *cobra.Command {
	var f storeFlags
	var asJSON bool
	var limit int
	var window time.Duration
	cmd := &cobra.Command{
		Use:   "stats",
		Short: "Print the inbox table's rows, sizes, age range, rows per consumer, attempt records and duplicate ages",
		Long: "Prints the processed rows (exact count), heap and index bytes (pg_table_size,\n" +
			"pg_indexes_size, summed over partitions), bytes per row, the oldest and newest row, the\n" +
			"rows per consumer, the attempt records pending and dead-lettered, and per consumer how\n" +
			"old its duplicates were when they arrived (the duplicate-age histogram: p50, p99, max;\n" +
			"with --window, the configured retention window, the margin left: the window minus the\n" +
			"max). It scans the table. Only the --limit consumers with the most rows (and with the\n" +
			"most duplicates) are listed (default " + fmt.Sprint(defaultStatsLimit) + ", 0 for all); the others are summed on one\n" +
			"line (in JSON: other_consumers and other_consumer_rows). With --json, one JSON object\n" +
			"for scripts.",
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if limit < 0 {
				return usageError{fmt.Errorf("--limit %d: want 0 (all) or more", limit)}
			}
			if cmd.Flags().Changed("window") && window <= 0 {
				return usageError{fmt.Errorf("--window %s: want a retention window above zero", days{&window})}
			}
			show := block
			if asJSON {
				show = jsonLines
			}
			return f.each(cmd, pgstore.Config{}, show, func(cmd *cobra.Command, url string) error {
				store, pool, err := f.connect(cmd.Context(), url, pgstore.Config{})
				if err != nil {
					return err
				}
				defer pool.Close()
				st, err := store.Stats(cmd.Context())
				if err != nil {
					return err
				}
				return printStats(cmd.OutOrStdout(), st, limit, window, asJSON)
			})
		},
	}
	f.registerMany(cmd)
	cmd.Flags().Var(days{&window}, "window", "the consumers' configured retention window, e.g. 14d: prints the margin it leaves above the oldest duplicate")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print one JSON object")
	cmd.Flags().IntVar(&limit, "limit", defaultStatsLimit, "list at most this many consumers, those with the most rows (0: all)")
	return cmd
}

// printStats prints st as text, or as one JSON object (printStatsJSON), with the limit
// consumers that have the most rows (topConsumers) and the others summed, and the duplicate
// ages of the limit consumers with the most duplicates, with the margin window leaves.
func printStats(w io.Writer, st pgstore.TableStats, limit int, window time.Duration, asJSON bool) error {
	names, others, otherRows := topConsumers(st.PerConsumer, limit)
	dupNames := topDuplicateAges(st.DuplicateAges, limit)
	if asJSON {
		return printStatsJSON(w, st, names, dupNames, others, otherRows, window)
	}
	ts := func(t *time.Time) string {
		if t == nil {
			return "-"
		}
		return t.UTC().Format(time.RFC3339)
	}
	fmt.Fprintf(w, "table            %s\n", st.Table)
	fmt.Fprintf(w, "rows             %d\n", st.Rows)
	fmt.Fprintf(w, "heap bytes       %d\n", st.HeapBytes)
	fmt.Fprintf(w, "index bytes      %d\n", st.IndexBytes)
	fmt.Fprintf(w, "bytes per row    %.1f\n", st.BytesPerRow)
	fmt.Fprintf(w, "oldest           %s\n", ts(st.Oldest))
	fmt.Fprintf(w, "newest           %s\n", ts(st.Newest))
	for _, n := range names {
		fmt.Fprintf(w, "consumer         %q: %d rows\n", n, st.PerConsumer[n])
	}
	if others > 0 {
		fmt.Fprintf(w, "other consumers  %d: %d rows (--limit %d shows more)\n", others, otherRows, limit)
	}
	fmt.Fprintf(w, "attempts table   %s (%d heap bytes, %d index bytes)\n", st.AttemptsTable, st.AttemptsHeapBytes, st.AttemptsIndexBytes)
	fmt.Fprintf(w, "attempts pending %d\n", st.AttemptsPending)
	fmt.Fprintf(w, "dead-lettered    %d\n", st.DeadLettered)
	for _, n := range dupNames {
		fmt.Fprintf(w, "duplicate ages   %q: %s\n", n, duplicateAgeLine(st.DuplicateAges[n], window))
	}
	if len(dupNames) < len(st.DuplicateAges) {
		fmt.Fprintf(w, "duplicate ages   %d other consumers (--limit %d shows more)\n", len(st.DuplicateAges)-len(dupNames), limit)
	}
	return nil
}

// defaultStatsLimit is the number of consumers `stats` lists by default.
const defaultStatsLimit = 50

// topConsumers returns the limit names of perConsumer with the most rows (ties by name; all
// of them for limit 0), and the count and rows of the others.
func topConsumers(perConsumer map[string]int64, limit int) (names []string, others int, otherRows int64) {
	names = make([]string, 0, len(perConsumer))
	for n := range perConsumer {
		names = append(names, n)
	}
	sort.Slice(names, func(i, j int) bool {
		if a, b := perConsumer[names[i]], perConsumer[names[j]]; a != b {
			return a > b
		}
		return names[i] < names[j]
	})
	if limit == 0 || len(names) <= limit {
		return names, 0, 0
	}
	for _, n := range names[limit:] {
		otherRows += perConsumer[n]
	}
	return names[:limit], len(names) - limit, otherRows
}

// printStatsJSON prints st as one JSON object, with the consumers names and dupNames only (the
// rest counted in other_consumers and other_consumer_rows) and, when window is set, the
// retention window and each listed consumer's margin, in seconds.
func printStatsJSON(w io.Writer, st pgstore.TableStats, names, dupNames []string, others int, otherRows int64, window time.Duration) error {
	shown := make(map[string]int64, len(names))
	for _, n := range names {
		shown[n] = st.PerConsumer[n]
	}
	st.PerConsumer = shown
	ages := make(map[string]pgstore.DuplicateAges, len(dupNames))
	var margins map[string]float64
	if window > 0 {
		margins = make(map[string]float64, len(dupNames))
	}
	for _, n := range dupNames {
		ages[n] = st.DuplicateAges[n]
		if window > 0 {
			margins[n] = window.Seconds() - st.DuplicateAges[n].MaxSeconds
		}
	}
	st.DuplicateAges = ages
	var windowSeconds *float64
	if window > 0 {
		ws := window.Seconds()
		windowSeconds = &ws
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		pgstore.TableStats
		OtherConsumers    int                `json:"other_consumers"`
		OtherConsumerRows int64              `json:"other_consumer_rows"`
		WindowSeconds     *float64           `json:"retention_window_seconds,omitempty"`
		MarginSeconds     map[string]float64 `json:"duplicate_age_margin_seconds,omitempty"`
	}{st, others, otherRows, windowSeconds, margins})
}

// topDuplicateAges returns the limit consumers of ages with the most duplicates (ties by
// name; all of them for limit 0).
func topDuplicateAges(ages map[string]pgstore.DuplicateAges, limit int) []string {
	counts := make(map[string]int64, len(ages))
	for n, h := range ages {
		counts[n] = h.Duplicates
	}
	names, _, _ := topConsumers(counts, limit)
	return names
}

// duplicateAgeLine describes one consumer's duplicate ages: the count, p50, p99 and max and,
// with window set, the margin the window leaves above the max.
func duplicateAgeLine(h pgstore.DuplicateAges, window time.Duration) string {
	line := fmt.Sprintf("%d duplicates, p50 %s, p99 %s, max %s", h.Duplicates, age(h.P50Seconds), age(h.P99Seconds), age(h.MaxSeconds))
	if window <= 0 {
		return line + " (--window for the margin)"
	}
	margin := window.Seconds() - h.MaxSeconds
	if margin < 0 {
		return line + fmt.Sprintf(", margin -%s: the %s window is shorter than the oldest duplicate", age(-margin), days{&window})
	}
	return line + fmt.Sprintf(", margin %s in the %s window", age(margin), days{&window})
}

// age formats seconds to the second, with days: "45s", "3h12m0s", "20d", "20d5s".
func age(seconds float64) string {
	d := time.Duration(math.Round(seconds)) * time.Second
	if d < 24*time.Hour {
		return d.String()
	}
	n, rest := d/(24*time.Hour), d%(24*time.Hour)
	if rest == 0 {
		return fmt.Sprintf("%dd", n)
	}
	return fmt.Sprintf("%dd%s", n, rest)
}
