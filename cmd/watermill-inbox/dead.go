package main

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// since reads --since: an RFC 3339 time, or a duration back from now ("24h", "7d").
func since(s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	var d time.Duration
	if err := (days{&d}).Set(s); err != nil {
		return time.Time{}, usageError{fmt.Errorf("--since: want an RFC 3339 time or a duration such as 24h or 7d, got %q", s)}
	}
	return time.Now().Add(-d), nil
}

func deadCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dead",
		Short: "List dead-lettered messages, or clear their state so they run again (replay)",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return usageError{fmt.Errorf("dead: name a subcommand: list or replay")}
		},
	}
	cmd.AddCommand(deadListCmd(), deadReplayCmd())
	return cmd
}

func deadListCmd() *cobra.Command {
	var f storeFlags
	var filter pgstore.DeadLetterFilter
	var sinceFlag string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List dead-lettered messages: key, consumer, attempts, when and why",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			var err error
			if filter.Since, err = since(sinceFlag); err != nil {
				return err
			}
			store, pool, err := f.connect(cmd.Context(), pgstore.Config{})
			if err != nil {
				return err
			}
			defer pool.Close()
			recs, err := store.DeadLetters(cmd.Context(), filter)
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			if asJSON {
				if recs == nil {
					recs = []pgstore.DeadLetterRecord{}
				}
				return json.NewEncoder(w).Encode(recs)
			}
			for _, r := range recs {
				fmt.Fprintf(w, "%s\t%q\t%q\tattempts=%d\treason=%q\n", r.DeadLettered.UTC().Format(time.RFC3339), r.ConsumerName, r.MessageID, r.Attempts, r.Reason)
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "%d dead-lettered\n", len(recs))
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().StringVar(&filter.ConsumerName, "consumer", "", "only this consumer")
	cmd.Flags().StringVar(&sinceFlag, "since", "", "only dead-lettered at or after: an RFC 3339 time or a duration back from now (24h, 7d)")
	cmd.Flags().IntVar(&filter.Limit, "limit", 1000, "at most this many (0: no limit)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	return cmd
}

func deadReplayCmd() *cobra.Command {
	var f storeFlags
	var consumer, sinceFlag string
	cmd := &cobra.Command{
		Use:   "replay [message-id] --consumer C | replay --consumer C --since T",
		Short: "Clear the dead-lettered state of one message, or of every one since T, so the next delivery runs the handler",
		Long: "Clears the dead-lettered state and attempt count (inbox.Inbox.Replay) of the named key, or\n" +
			"of every key of --consumer dead-lettered since --since. The next delivery of each runs\n" +
			"the handler again: republish the dead letters from the dead-letter topic (or let the\n" +
			"broker redeliver). The key is the one `dead list` prints (the business key when the\n" +
			"consumer uses one).",
		Args: usageArgs(cobra.MaximumNArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			if consumer == "" {
				return usageError{fmt.Errorf("--consumer is required")}
			}
			if (len(args) == 1) == (sinceFlag != "") {
				return usageError{fmt.Errorf("name one message ID, or --since, not both and not neither")}
			}
			from, err := since(sinceFlag)
			if err != nil {
				return err
			}
			store, pool, err := f.connect(cmd.Context(), pgstore.Config{})
			if err != nil {
				return err
			}
			defer pool.Close()
			ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: consumer}, nil)
			if err != nil {
				return usageError{err}
			}
			keys := args
			if len(args) == 0 {
				recs, err := store.DeadLetters(cmd.Context(), pgstore.DeadLetterFilter{ConsumerName: consumer, Since: from})
				if err != nil {
					return err
				}
				for _, r := range recs {
					keys = append(keys, r.MessageID)
				}
			}
			w := cmd.OutOrStdout()
			n := 0
			for _, k := range keys {
				ok, err := ib.Replay(cmd.Context(), k)
				if err != nil {
					return fmt.Errorf("replay %q: %w (%d cleared before it)", k, err, n)
				}
				if !ok {
					if len(args) == 1 {
						return fmt.Errorf("replay %q: %w", k, inbox.ErrNotDeadLettered)
					}
					continue // replayed meanwhile
				}
				n++
				fmt.Fprintf(w, "cleared %q\n", k)
			}
			fmt.Fprintf(w, "%d cleared for consumer %q: republish them from the dead-letter topic (or let the broker redeliver)\n", n, consumer)
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().StringVar(&consumer, "consumer", "", "the consumer name (required)")
	cmd.Flags().StringVar(&sinceFlag, "since", "", "every dead letter of --consumer since: an RFC 3339 time or a duration back from now")
	return cmd
}
