// Package dblist reads the list of databases an operator's command runs on (repeated
// --database-url flags and a file of URLs) and labels each database for output by its host,
// port and database name: never by its user, password or full URL. It is the one place of
// that rule.
package dblist

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/internal/redact"
)

// ErrList marks an error of the list itself (a file that cannot be read, a line too long, a
// database named twice, an empty file): the caller's, reported before anything connects.
var ErrList = errors.New("database list")

// maxLine is the longest line of a databases file, in bytes.
const maxLine = 64 << 10

// Database is one database of the list.
type Database struct {
	// URL is the connection string as given (a URL or a keyword/value string). It may hold a
	// password: never print it.
	URL string
	// Label names the database in output: "host:port/dbname" (Label), or "database N" (N
	// its 1-based position in the list) when the connection string cannot be read.
	Label string
}

// Read returns the databases of urls (the --database-url flags, in order), then those of the
// file at path ("" for none; ReadFile's format), each labelled. An error wraps ErrList and
// names the file and the line, never a line's content: a file that cannot be read, a line
// longer than 64 KiB, a file that names no database, two entries with the same label (the
// same host, port and database name).
func Read(urls []string, path string) ([]Database, error) {
	all := append([]string(nil), urls...)
	if path != "" {
		fromFile, err := ReadFile(path)
		if err != nil {
			return nil, err
		}
		all = append(all, fromFile...)
	}
	dbs := make([]Database, 0, len(all))
	seen := make(map[string]int, len(all))
	for i, u := range all {
		label, ok := Label(u)
		if !ok {
			label = "database " + strconv.Itoa(i+1)
		}
		if j, dup := seen[label]; dup {
			return nil, fmt.Errorf("%w: entries %d and %d are the same database %s", ErrList, j+1, i+1, label)
		}
		seen[label] = i
		dbs = append(dbs, Database{URL: u, Label: label})
	}
	return dbs, nil
}

// ReadFile returns the connection strings of a databases file, one a line in file order:
// surrounding white space is trimmed, and empty lines and lines whose first character
// (after white space) is '#' are skipped. A '#' elsewhere is part of the string. An error
// wraps ErrList: the file cannot be read, a line is longer than 64 KiB, no line names a
// database.
func ReadFile(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrList, err)
	}
	defer func() { _ = f.Close() }()
	urls, err := parse(f)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrList, path, err)
	}
	if len(urls) == 0 {
		return nil, fmt.Errorf("%w: %s names no database", ErrList, path)
	}
	return urls, nil
}

func parse(r io.Reader) ([]string, error) {
	var urls []string
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 4096), maxLine)
	n := 0
	for sc.Scan() {
		n++
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		urls = append(urls, line)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("after line %d: %w", n, err)
	}
	return urls, nil
}

// Label returns the label of a connection string: "host:port/dbname" as pgx would connect
// (pgconn.ParseConfig: the environment's PGHOST, PGPORT and PGDATABASE fill what the string
// leaves out), with each fallback host after a comma ("h1:5432,h2:5432/db"), and the name
// quoted (redact.String) when it holds a control character. It reports false when the string
// cannot be read, or when the label would hold one of its secrets (redact.Secrets): the
// caller then labels it by position.
func Label(conn string) (string, bool) {
	cfg, err := pgconn.ParseConfig(conn)
	if err != nil {
		return "", false
	}
	// pgx lists a host once per TLS mode it tries (sslmode=prefer: with TLS, then without).
	hosts := []string{net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))}
	for _, fb := range cfg.Fallbacks {
		if h := net.JoinHostPort(fb.Host, strconv.Itoa(int(fb.Port))); !slices.Contains(hosts, h) {
			hosts = append(hosts, h)
		}
	}
	label := redact.String(strings.Join(hosts, ",") + "/" + cfg.Database)
	for _, s := range redact.Secrets(conn) {
		if strings.Contains(label, s) {
			return "", false
		}
	}
	return label, true
}
