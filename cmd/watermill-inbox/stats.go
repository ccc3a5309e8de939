package main

import (
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"time"

	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

func statsCmd() *cobra.Command {
	var f storeFlags
	var asJSON bool
	var limit int
	cmd := &cobra.Command{
		Use:   "stats",
		Short: "Print the inbox table's rows, sizes, age range, rows per consumer and attempt records",
		Long: "Prints the processed rows (exact count), heap and index bytes (pg_table_size,\n" +
			"pg_indexes_size, summed over partitions), bytes per row, the oldest and newest row, the\n" +
			"rows per consumer, and the attempt records pending and dead-lettered. It scans the\n" +
			"table. Only the --limit consumers with the most rows are listed (default " + fmt.Sprint(defaultStatsLimit) + ",\n" +
			"0 for all); the others are summed on one line (in JSON: other_consumers and\n" +
			"other_consumer_rows). With --json, one JSON object for scripts.",
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if limit < 0 {
				return usageError{fmt.Errorf("--limit %d: want 0 (all) or more", limit)}
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
				return printStats(cmd.OutOrStdout(), st, limit, asJSON)
			})
		},
	}
	f.registerMany(cmd)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print one JSON object")
	cmd.Flags().IntVar(&limit, "limit", defaultStatsLimit, "list at most this many consumers, those with the most rows (0: all)")
	return cmd
}

// printStats prints st as text, or as one JSON object, with the limit consumers that have
// the most rows (topConsumers) and the others summed.
func printStats(w io.Writer, st pgstore.TableStats, limit int, asJSON bool) error {
	names, others, otherRows := topConsumers(st.PerConsumer, limit)
	if asJSON {
		shown := make(map[string]int64, len(names))
		for _, n := range names {
			shown[n] = st.PerConsumer[n]
		}
		st.PerConsumer = shown
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(struct {
			pgstore.TableStats
			OtherConsumers    int   `json:"other_consumers"`
			OtherConsumerRows int64 `json:"other_consumer_rows"`
		}{st, others, otherRows})
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
