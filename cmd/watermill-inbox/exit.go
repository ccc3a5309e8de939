package main

import (
	"errors"
	"strings"

	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// Exit statuses of the command (documented in the package doc and docs/retention.md).
const (
	exitOK    = 0
	exitError = 1 // an error while running
	exitUsage = 2 // bad flags, arguments or configuration, reported before any change
	exitBusy  = 3 // purge: another purge of the table holds the purge lock
	// exitRefused: layout convert will not convert as asked (keys the new layout cannot
	// hold, a source layout it does not convert from, <table>_old exists); nothing changed.
	exitRefused = 4
)

// usageError marks an error as the caller's: exit status 2.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// exitCode maps a command's error to the process exit status.
func exitCode(err error) int {
	var u usageError
	var many *databasesError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &many):
		return many.code
	case errors.As(err, &u), errors.Is(err, inbox.ErrInvalidConfig),
		strings.HasPrefix(err.Error(), "unknown command"), strings.HasPrefix(err.Error(), "unknown flag"):
		return exitUsage
	case errors.Is(err, pgstore.ErrPurgeInProgress):
		return exitBusy
	case errors.As(err, new(refusedError)):
		return exitRefused
	}
	return exitError
}

// usageArgs wraps a cobra argument validator so its error is a usage error.
func usageArgs(v cobra.PositionalArgs) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if err := v(cmd, args); err != nil {
			return usageError{err}
		}
		return nil
	}
}
