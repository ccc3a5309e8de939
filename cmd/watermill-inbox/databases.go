package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/watermill-inbox/watermill-inbox/internal/dblist"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// dbFlags are the databases of a command that runs on several: repeated --database-url flags
// and a --databases-file (package dblist reads and labels them).
type dbFlags struct {
	urls []string
	file string
}

func (d *dbFlags) register(cmd *cobra.Command, urlHelp string) {
	cmd.Flags().StringArrayVar(&d.urls, "database-url", nil, urlHelp)
	cmd.Flags().StringVar(&d.file, "databases-file", "", "a file of PostgreSQL URLs, one a line (# starts a comment line); the command runs on each")
}

// given reports whether a database was named by a flag (an empty --database-url names none).
func (d *dbFlags) given() bool {
	return d.file != "" || len(d.nonEmpty()) > 0
}

func (d *dbFlags) nonEmpty() []string {
	var out []string
	for _, u := range d.urls {
		if u != "" {
			out = append(out, u)
		}
	}
	return out
}

// list returns the databases the flags name, or, when they name none, one database whose URL
// is fallback() (the environment's; "" when none is set, which the command reports as it
// always has). A bad list (dblist.ErrList) is a usage error.
func (d *dbFlags) list(fallback func() string) ([]dblist.Database, error) {
	if !d.given() {
		return []dblist.Database{{URL: fallback()}}, nil
	}
	dbs, err := dblist.Read(d.nonEmpty(), d.file)
	if err != nil {
		return nil, usageError{err}
	}
	return dbs, nil
}

// registerMany registers the flags of a store command that runs on several databases:
// --database-url (repeatable), --databases-file, --schema and --table.
func (f *storeFlags) registerMany(cmd *cobra.Command) {
	f.dbs.register(cmd, "PostgreSQL URL; repeat it to run on several databases (default $INBOX_DATABASE_URL, then $DATABASE_URL)")
	f.registerNames(cmd)
}

// each checks cfg (storeFlags.check: the names, the retention window), then runs one on
// every database of f (eachDatabase).
func (f *storeFlags) each(cmd *cobra.Command, cfg pgstore.Config, show output, one func(cmd *cobra.Command, url string) error) error {
	if _, err := f.check(cfg); err != nil {
		return err
	}
	dbs, err := f.dbs.list(f.url)
	if err != nil {
		return err
	}
	return eachDatabase(cmd, dbs, show, one)
}

// output is how a command shows each database's output when it runs on several.
type output int

const (
	// oneLine: "label: " and the database's output lines joined by "; ", then "error: ..."
	// if it failed ("label: ok" for no output).
	oneLine output = iota
	// block: a line "== label ==", the database's output as it is, "error: ..." if it
	// failed; a blank line between databases.
	block
	// jsonLines: one JSON object a line, {"database": label, "result": <the output's JSON>}
	// or {"database": label, "error": "..."}.
	jsonLines
)

// eachDatabase runs one on each of dbs in order, each after the others whatever they
// returned. One database runs exactly as the command always has: its output and its error
// as they are (the error masked for its URL). Several: each database's output is shown as
// show says, labelled (dblist.Label: host, port and database name, never a user, password
// or URL), its standard error lines prefixed by "label: ", its error masked (mask, with every
// URL of the list) on its own line; the result is nil when all succeeded, else a
// *databasesError whose exit status is that of the failures when they all share one, else 1.
func eachDatabase(cmd *cobra.Command, dbs []dblist.Database, show output, one func(cmd *cobra.Command, url string) error) error {
	if len(dbs) == 1 {
		return mask(cmd, one(cmd, dbs[0].URL), dbs[0].URL)
	}
	urls := make([]string, len(dbs))
	for i, db := range dbs {
		urls[i] = db.URL
	}
	stdout, stderr := cmd.OutOrStdout(), cmd.ErrOrStderr()
	defer func() { cmd.SetOut(stdout); cmd.SetErr(stderr) }()
	res := &databasesError{total: len(dbs), code: exitOK}
	for i, db := range dbs {
		var buf bytes.Buffer
		errw := &prefixWriter{w: stderr, prefix: db.Label + ": "}
		cmd.SetOut(&buf)
		cmd.SetErr(errw)
		if show == block {
			if i > 0 {
				fmt.Fprintln(stdout)
			}
			fmt.Fprintf(stdout, "== %s ==\n", db.Label)
			cmd.SetOut(stdout)
		}
		err := one(cmd, db.URL)
		errw.flush()
		text := ""
		if err != nil {
			res.add(db.Label, exitCode(err))
			text = errText(cmd, err, db, urls)
		}
		showResult(stdout, show, db.Label, buf.Bytes(), text)
	}
	if len(res.failed) == 0 {
		return nil
	}
	return res
}

// showResult prints one database's output (out; already printed for block) and its error's
// text (errText; "" when it succeeded).
func showResult(w io.Writer, show output, label string, out []byte, errText string) {
	switch show {
	case block:
		if errText != "" {
			fmt.Fprintf(w, "error: %s\n", errText)
		}
	case jsonLines:
		line := struct {
			Database string          `json:"database"`
			Result   json.RawMessage `json:"result,omitempty"`
			Error    string          `json:"error,omitempty"`
		}{Database: label}
		var compact bytes.Buffer
		switch {
		case errText != "":
			line.Error = errText
		case json.Compact(&compact, out) == nil && compact.Len() > 0:
			line.Result = compact.Bytes()
		default:
			line.Error = "the command printed no JSON"
		}
		b, _ := json.Marshal(line)
		fmt.Fprintf(w, "%s\n", b)
	default:
		var parts []string
		for _, l := range strings.Split(string(out), "\n") {
			if l = strings.TrimSpace(l); l != "" {
				parts = append(parts, l)
			}
		}
		if errText != "" {
			parts = append(parts, "error: "+errText)
		}
		if len(parts) == 0 {
			parts = []string{"ok"}
		}
		fmt.Fprintf(w, "%s: %s\n", label, strings.Join(parts, "; "))
	}
}

// errText is the text of db's error on one line: its URL, as given or as redact.ConnString
// prints it, replaced by its label, every other secret masked (mask, with urls), runs of
// white space (pgx's errors hold newlines and tabs) made one space, any other control
// character quoted (redact.String).
func errText(cmd *cobra.Command, err error, db dblist.Database, urls []string) string {
	t := err.Error()
	if db.URL != "" {
		t = strings.ReplaceAll(t, db.URL, db.Label)
		t = strings.ReplaceAll(t, redact.ConnString(db.URL), db.Label)
	}
	t = mask(cmd, errors.New(t), urls...).Error()
	if t == "" {
		t = "failed"
	}
	return redact.String(strings.Join(strings.Fields(t), " "))
}

// databasesError is the error of a command that failed on some of several databases.
type databasesError struct {
	failed []string // labels, in list order
	total  int
	code   int // the failures' common exit status, else exitError
}

func (e *databasesError) add(label string, code int) {
	if len(e.failed) > 0 && e.code != code {
		code = exitError
	}
	e.failed = append(e.failed, label)
	e.code = code
}

func (e *databasesError) Error() string {
	return fmt.Sprintf("%d of %d databases failed: %s", len(e.failed), e.total, strings.Join(e.failed, ", "))
}

// prefixWriter writes each line written to it to w with prefix before it.
type prefixWriter struct {
	w      io.Writer
	prefix string
	line   []byte
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	p.line = append(p.line, b...)
	for {
		i := bytes.IndexByte(p.line, '\n')
		if i < 0 {
			return len(b), nil
		}
		if _, err := fmt.Fprintf(p.w, "%s%s\n", p.prefix, p.line[:i]); err != nil {
			return len(b), err
		}
		p.line = p.line[i+1:]
	}
}

// flush writes a last line that has no newline.
func (p *prefixWriter) flush() {
	if len(p.line) > 0 {
		fmt.Fprintf(p.w, "%s%s\n", p.prefix, p.line)
		p.line = nil
	}
}
