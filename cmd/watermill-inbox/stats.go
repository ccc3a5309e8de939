package main

import (
	"encoding/json"
	"fmt"
	"sort"
	"time"

	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

func statsCmd() *cobra.Command {
	var f storeFlags
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "stats",
		Short: "Print the inbox table's rows, sizes, age range, rows per consumer and attempt records",
		Long: "Prints the processed rows (exact count), heap and index bytes (pg_table_size,\n" +
			"pg_indexes_size, summed over partitions), bytes per row, the oldest and newest row, the\n" +
			"rows per consumer, and the attempt records pending and dead-lettered. It scans the\n" +
			"table. With --json, one JSON object for scripts.",
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			store, pool, err := f.connect(cmd.Context(), pgstore.Config{})
			if err != nil {
				return err
			}
			defer pool.Close()
			st, err := store.Stats(cmd.Context())
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			if asJSON {
				enc := json.NewEncoder(w)
				enc.SetIndent("", "  ")
				return enc.Encode(st)
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
			names := make([]string, 0, len(st.PerConsumer))
			for n := range st.PerConsumer {
				names = append(names, n)
			}
			sort.Strings(names)
			for _, n := range names {
				fmt.Fprintf(w, "consumer         %q: %d rows\n", n, st.PerConsumer[n])
			}
			fmt.Fprintf(w, "attempts table   %s (%d heap bytes, %d index bytes)\n", st.AttemptsTable, st.AttemptsHeapBytes, st.AttemptsIndexBytes)
			fmt.Fprintf(w, "attempts pending %d\n", st.AttemptsPending)
			fmt.Fprintf(w, "dead-lettered    %d\n", st.DeadLettered)
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print one JSON object")
	return cmd
}
