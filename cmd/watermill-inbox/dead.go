package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// pointInTime reads --since or --until (named by flag): an RFC 3339 time, or a duration back
// from now ("24h", "7d"). "" is the zero time (no bound).
func pointInTime(flag, s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	var d time.Duration
	if err := (days{&d}).Set(s); err != nil {
		return time.Time{}, usageError{fmt.Errorf("%s: want an RFC 3339 time or a duration such as 24h or 7d, got %q", flag, s)}
	}
	return time.Now().Add(-d), nil
}

func deadCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dead",
		Short: "List dead-lettered messages by reason, clear their state so they run again (replay), or discard them",
		Args:  usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return usageError{fmt.Errorf("dead: name a subcommand: list, replay or discard")}
		},
	}
	cmd.AddCommand(deadListCmd(), deadReplayCmd(), deadDiscardCmd())
	return cmd
}

// deadSelection is the flags that select dead letters: a consumer, a reason and a time range
// of dead_lettered_at.
type deadSelection struct {
	consumer, reason, since, until string
}

func (s *deadSelection) register(cmd *cobra.Command, consumerHelp string) {
	fl := cmd.Flags()
	fl.StringVar(&s.consumer, "consumer", "", consumerHelp)
	fl.StringVar(&s.reason, "reason", "", "only dead letters with exactly this reason (as dead list prints it)")
	fl.StringVar(&s.since, "since", "", "only dead-lettered at or after: an RFC 3339 time or a duration back from now (24h, 7d)")
	fl.StringVar(&s.until, "until", "", "only dead-lettered before: an RFC 3339 time or a duration back from now")
}

// ranged reports whether a reason or a time bound was given (a selection beyond the consumer).
func (s *deadSelection) ranged() bool { return s.reason != "" || s.since != "" || s.until != "" }

// filter returns the selection as a store filter, or a usage error for a bad time or an empty
// range.
func (s *deadSelection) filter() (pgstore.DeadLetterFilter, error) {
	f := pgstore.DeadLetterFilter{ConsumerName: s.consumer, Reason: s.reason}
	var err error
	if f.Since, err = pointInTime("--since", s.since); err != nil {
		return f, err
	}
	if f.Until, err = pointInTime("--until", s.until); err != nil {
		return f, err
	}
	if !f.Since.IsZero() && !f.Until.IsZero() && !f.Since.Before(f.Until) {
		return f, usageError{errors.New("--since must be before --until")}
	}
	return f, nil
}

func deadListCmd() *cobra.Command {
	var f storeFlags
	var sel deadSelection
	var limit int
	var records, asJSON bool
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List dead letters grouped by consumer and reason (count, first and last seen), or each record (--records)",
		Long: "Groups the dead-lettered records by consumer and reason: how many, when the first and the\n" +
			"last were dead-lettered, the group seen first first. --records lists each record instead:\n" +
			"when, consumer, key, attempts, reason. Work through one incident at a time: take a reason\n" +
			"from here to dead replay or dead discard with --reason, --since and --until.",
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			filter, err := sel.filter()
			if err != nil {
				return err
			}
			filter.Limit = limit
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
				if records {
					return listDeadRecords(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), store, filter, asJSON)
				}
				return listDeadReasons(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), store, filter, asJSON)
			})
		},
	}
	f.registerMany(cmd)
	sel.register(cmd, "only this consumer")
	cmd.Flags().IntVar(&limit, "limit", 1000, "at most this many groups (with --records: records) (0: no limit)")
	cmd.Flags().BoolVar(&records, "records", false, "list each dead-lettered record, oldest first, instead of the groups")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	return cmd
}

// listDeadReasons prints the groups of dead letters filter selects, one line each (or a JSON
// array), and their total to errw.
func listDeadReasons(ctx context.Context, w, errw io.Writer, store *pgstore.Store, filter pgstore.DeadLetterFilter, asJSON bool) error {
	groups, err := store.DeadLetterReasons(ctx, filter)
	if err != nil {
		return err
	}
	if asJSON {
		if groups == nil {
			groups = []pgstore.DeadLetterReason{}
		}
		return json.NewEncoder(w).Encode(groups)
	}
	var n int64
	for _, g := range groups {
		fmt.Fprintf(w, "%q\treason=%q\tcount=%d\tfirst=%s\tlast=%s\n", g.ConsumerName, g.Reason, g.Count,
			g.FirstSeen.UTC().Format(time.RFC3339), g.LastSeen.UTC().Format(time.RFC3339))
		n += g.Count
	}
	fmt.Fprintf(errw, "%d dead-lettered in %d groups\n", n, len(groups))
	return nil
}

// listDeadRecords prints the dead-lettered records filter selects, one line each (or a JSON
// array), and their number to errw.
func listDeadRecords(ctx context.Context, w, errw io.Writer, store *pgstore.Store, filter pgstore.DeadLetterFilter, asJSON bool) error {
	recs, err := store.DeadLetters(ctx, filter)
	if err != nil {
		return err
	}
	if asJSON {
		if recs == nil {
			recs = []pgstore.DeadLetterRecord{}
		}
		return json.NewEncoder(w).Encode(recs)
	}
	for _, r := range recs {
		fmt.Fprintf(w, "%s\t%q\t%q\tattempts=%d\treason=%q\n", r.DeadLettered.UTC().Format(time.RFC3339), r.ConsumerName, r.MessageID, r.Attempts, r.Reason)
	}
	fmt.Fprintf(errw, "%d dead-lettered\n", len(recs))
	return nil
}

// deadTarget reads a replay's or a discard's arguments: one message ID, or a selection
// (--reason, --since, --until), not both and not neither; --consumer always. It returns the
// filter of the dead letters to act on.
func deadTarget(sel *deadSelection, args []string) (pgstore.DeadLetterFilter, error) {
	if sel.consumer == "" {
		return pgstore.DeadLetterFilter{}, usageError{errors.New("--consumer is required")}
	}
	if (len(args) == 1) == sel.ranged() {
		return pgstore.DeadLetterFilter{}, usageError{errors.New("name one message ID, or select with --reason, --since or --until, not both and not neither")}
	}
	filter, err := sel.filter()
	if len(args) == 1 {
		filter.MessageID = args[0]
	}
	return filter, err
}

// printDryRun prints what filter selects, by reason, and what the command would do with it.
func printDryRun(ctx context.Context, w io.Writer, store *pgstore.Store, filter pgstore.DeadLetterFilter, verb string) error {
	groups, err := store.DeadLetterReasons(ctx, filter)
	if err != nil {
		return err
	}
	var n int64
	for _, g := range groups {
		fmt.Fprintf(w, "would %s %d\treason=%q\tfirst=%s\tlast=%s\n", verb, g.Count, g.Reason,
			g.FirstSeen.UTC().Format(time.RFC3339), g.LastSeen.UTC().Format(time.RFC3339))
		n += g.Count
	}
	_, err = fmt.Fprintf(w, "dry run: would %s %d dead letters of consumer %q; nothing changed\n", verb, n, filter.ConsumerName)
	return err
}

func deadReplayCmd() *cobra.Command {
	var f storeFlags
	var sel deadSelection
	var dryRun bool
	cmd := &cobra.Command{
		Use:   "replay [message-id] --consumer C | replay --consumer C [--reason R] [--since T] [--until T]",
		Short: "Clear the dead-lettered state of one message, or of those selected by reason and time, so the next delivery runs the handler",
		Long: "Clears the dead-lettered state and attempt count (inbox.Inbox.Replay) of the named key, or\n" +
			"of every key of --consumer selected by --reason (exact), --since (inclusive) and --until\n" +
			"(exclusive) on the time it was dead-lettered. The next delivery of each runs the handler\n" +
			"again: republish the dead letters from the dead-letter topic (or let the broker\n" +
			"redeliver). A dead letter whose key was processed since is refused and its record\n" +
			"deleted. The key is the one `dead list --records` prints (the business key when the\n" +
			"consumer uses one). --dry-run prints what would be cleared, by reason, and changes nothing.",
		Args: usageArgs(cobra.MaximumNArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			filter, err := deadTarget(&sel, args)
			if err != nil {
				return err
			}
			return f.each(cmd, pgstore.Config{}, oneLine, func(cmd *cobra.Command, url string) error {
				store, pool, err := f.connect(cmd.Context(), url, pgstore.Config{})
				if err != nil {
					return err
				}
				defer pool.Close()
				return replayDead(cmd, store, filter, args, dryRun)
			})
		},
	}
	f.registerMany(cmd)
	sel.register(cmd, "the consumer name (required)")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "print what would be cleared, by reason; change nothing")
	return cmd
}

// replayDead clears the dead-lettered state of the key args names, or of those filter
// selects (only printing them by reason with dryRun), and prints each cleared key and their
// number. A named key that is not dead-lettered is inbox.ErrNotDeadLettered.
func replayDead(cmd *cobra.Command, store *pgstore.Store, filter pgstore.DeadLetterFilter, args []string, dryRun bool) error {
	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: filter.ConsumerName}, nil)
	if err != nil {
		return usageError{err}
	}
	w := cmd.OutOrStdout()
	if dryRun {
		return printDryRun(cmd.Context(), w, store, filter, "clear")
	}
	keys := args
	if len(args) == 0 {
		recs, err := store.DeadLetters(cmd.Context(), filter)
		if err != nil {
			return err
		}
		for _, r := range recs {
			keys = append(keys, r.MessageID)
		}
	}
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
			continue // replayed meanwhile, or processed since
		}
		n++
		fmt.Fprintf(w, "cleared %q\n", k)
	}
	fmt.Fprintf(w, "%d cleared for consumer %q: republish them from the dead-letter topic (or let the broker redeliver)\n", n, filter.ConsumerName)
	return nil
}

func deadDiscardCmd() *cobra.Command {
	var f storeFlags
	var sel deadSelection
	var dryRun bool
	cmd := &cobra.Command{
		Use:   "discard [message-id] --consumer C | discard --consumer C [--reason R] [--since T] [--until T]",
		Short: "Delete the dead-letter records of one message, or of those selected by reason and time, that nobody will replay",
		Long: "Deletes the dead-lettered records (pgstore.Store.DiscardDeadLetters) of the named key, or\n" +
			"of every key of --consumer selected by --reason (exact), --since (inclusive) and --until\n" +
			"(exclusive) on the time it was dead-lettered: what the purge does once the dead-letter\n" +
			"window has passed, done now for one incident. The key is then no longer dead-lettered:\n" +
			"a copy delivered later runs the handler as a new message (and, if it fails again, is\n" +
			"dead-lettered again). Drop the messages from the dead-letter topic too. --dry-run prints\n" +
			"what would be discarded, by reason, and changes nothing.",
		Args: usageArgs(cobra.MaximumNArgs(1)),
		RunE: func(cmd *cobra.Command, args []string) error {
			filter, err := deadTarget(&sel, args)
			if err != nil {
				return err
			}
			return f.each(cmd, pgstore.Config{}, oneLine, func(cmd *cobra.Command, url string) error {
				store, pool, err := f.connect(cmd.Context(), url, pgstore.Config{})
				if err != nil {
					return err
				}
				defer pool.Close()
				w := cmd.OutOrStdout()
				if dryRun {
					return printDryRun(cmd.Context(), w, store, filter, "discard")
				}
				n, err := store.DiscardDeadLetters(cmd.Context(), filter)
				if err != nil {
					return fmt.Errorf("%w (%d discarded before the error)", err, n)
				}
				if len(args) == 1 && n == 0 {
					return fmt.Errorf("discard %q: %w", args[0], inbox.ErrNotDeadLettered)
				}
				_, err = fmt.Fprintf(w, "%d discarded for consumer %q\n", n, sel.consumer)
				return err
			})
		},
	}
	f.registerMany(cmd)
	sel.register(cmd, "the consumer name (required)")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "print what would be discarded, by reason; change nothing")
	return cmd
}
