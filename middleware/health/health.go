// Package health is the inbox's readiness check for Kubernetes probes and load balancers: the
// database is reachable, the inbox migrations are at the version this binary expects, and
// every inbox that must dead-letter has a dead-letter topic. It is a function (Readiness.Check)
// and an http.Handler (Readiness itself).
//
//	ready := health.NewReadiness(health.Config{},
//		health.Database(pool),
//		health.Migrations(store),
//		health.DeadLetters(billing))
//	http.Handle("/readyz", ready)
//
// Use it for readiness, not liveness: a database outage should take the pod out of the load
// balancer, not restart it.
package health

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// DefaultTimeout bounds all checks of one Check call.
const DefaultTimeout = 3 * time.Second

// Check is one named readiness check. Run returns nil when ready, else an error saying what is
// wrong and how to fix it; it must honour ctx.
type Check struct {
	// Name identifies the check in reports, e.g. "database".
	Name string
	// Run performs the check.
	Run func(ctx context.Context) error
}

// Pinger is what Database checks: *pgxpool.Pool, *pgx.Conn.
type Pinger interface {
	Ping(ctx context.Context) error
}

// Database is ready when p answers a ping (a round trip to PostgreSQL, taking a pool
// connection or opening one).
func Database(p Pinger) Check {
	return Check{Name: "database", Run: func(ctx context.Context) error {
		if err := p.Ping(ctx); err != nil {
			return fmt.Errorf("database unreachable: %w", err)
		}
		return nil
	}}
}

// SchemaChecker verifies a store's schema without changing it, e.g. a pgstore function that
// compares the database with the migrations the binary embeds.
type SchemaChecker interface {
	CheckSchema(ctx context.Context) error
}

// Schema is ready when sc.CheckSchema returns nil.
func Schema(sc SchemaChecker) Check {
	return Check{Name: "schema", Run: sc.CheckSchema}
}

// ErrMigrationsMissing is wrapped by the Migrations check's error when migrations this binary
// embeds are not recorded as applied.
var ErrMigrationsMissing = errors.New("inbox migrations not applied")

// Migrations is ready when every migration store embeds (store.Migrations) is recorded as
// applied for its table in the schema's watermill_inbox_migrations table, which Migrate and
// the script of MigrationSQL write. It only reads. An error wraps ErrMigrationsMissing and
// names the missing versions, or names the query that failed (a missing versions table means
// no migration ever ran).
func Migrations(store *pgstore.Store) Check {
	return Check{Name: "migrations", Run: func(ctx context.Context) error {
		ms, err := store.Migrations()
		if err != nil {
			return err
		}
		versions := pgx.Identifier{store.Config().Schema, "watermill_inbox_migrations"}.Sanitize()
		rows, err := store.Pool().Query(ctx, "SELECT version FROM "+versions+" WHERE table_name = $1", store.Table())
		var applied []int32
		if err == nil {
			applied, err = pgx.CollectRows(rows, pgx.RowTo[int32])
		}
		if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
			return fmt.Errorf("%w: %s does not exist: no migration ever ran for %s (run store.Migrate or `watermill-inbox migrate`)", ErrMigrationsMissing, versions, store.Table())
		}
		if err != nil {
			return fmt.Errorf("reading %s: %w", versions, err)
		}
		var missing []string
		for _, m := range ms {
			if !slices.Contains(applied, int32(m.Version)) {
				missing = append(missing, m.Name)
			}
		}
		if len(missing) > 0 {
			return fmt.Errorf("%w: %s lacks %s (run store.Migrate or `watermill-inbox migrate`)", ErrMigrationsMissing, store.Table(), strings.Join(missing, ", "))
		}
		return nil
	}}
}

// ErrNoDeadLetterTopic is wrapped by the DeadLetters check's error.
var ErrNoDeadLetterTopic = errors.New("inbox has no dead-letter topic")

// DeadLetters is ready when every one of inboxes has a dead-letter publisher and topic
// (inbox.Config.DeadLetterPublisher): without one, a poison message is redelivered forever.
// List the inboxes your deployment requires to dead-letter.
func DeadLetters(inboxes ...*inbox.Inbox) Check {
	return Check{Name: "dead_letters", Run: func(context.Context) error {
		var missing []string
		for _, ib := range inboxes {
			if ib.DeadLetterTopic() == "" {
				missing = append(missing, ib.ConsumerName())
			}
		}
		if len(missing) > 0 {
			return fmt.Errorf("%w: consumer %s (set DeadLetterPublisher and DeadLetterTopic)", ErrNoDeadLetterTopic, strings.Join(missing, ", "))
		}
		return nil
	}}
}

// Config configures a Readiness.
type Config struct {
	// Timeout bounds one Check call (all checks run concurrently). Default: DefaultTimeout.
	Timeout time.Duration
}

// Readiness runs a set of checks. It is safe for concurrent use and serves HTTP.
type Readiness struct {
	cfg    Config
	checks []Check
}

// NewReadiness returns a Readiness running checks.
func NewReadiness(cfg Config, checks ...Check) *Readiness {
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultTimeout
	}
	return &Readiness{cfg: cfg, checks: checks}
}

// Result is one check's outcome.
type Result struct {
	Name  string `json:"name"`
	OK    bool   `json:"ok"`
	Error string `json:"error,omitempty"`
}

// NotReadyError is returned by Check when a check failed; it lists every check's result.
type NotReadyError struct {
	Results []Result
	errs    []error
}

func (e *NotReadyError) Error() string {
	var b strings.Builder
	b.WriteString("not ready:")
	for _, r := range e.Results {
		if !r.OK {
			fmt.Fprintf(&b, " %s: %s;", r.Name, r.Error)
		}
	}
	return strings.TrimSuffix(b.String(), ";")
}

// Unwrap returns the failed checks' errors, so errors.Is finds ErrMigrationsMissing and kin.
func (e *NotReadyError) Unwrap() []error { return e.errs }

// Check runs every check concurrently within Config.Timeout and returns the results, with a
// *NotReadyError when any failed (a check still running at the timeout fails with the
// context's error).
func (r *Readiness) Check(ctx context.Context) ([]Result, error) {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.Timeout)
	defer cancel()
	results := make([]Result, len(r.checks))
	errs := make([]error, len(r.checks))
	var wg sync.WaitGroup
	for i, c := range r.checks {
		wg.Go(func() {
			err := c.Run(ctx)
			results[i] = Result{Name: c.Name, OK: err == nil}
			if err != nil {
				results[i].Error = err.Error()
				errs[i] = fmt.Errorf("%s: %w", c.Name, err)
			}
		})
	}
	wg.Wait()
	var failed []error
	for _, err := range errs {
		if err != nil {
			failed = append(failed, err)
		}
	}
	if len(failed) > 0 {
		return results, &NotReadyError{Results: results, errs: failed}
	}
	return results, nil
}

// ServeHTTP answers 200 when every check passes and 503 otherwise, with a JSON body
// {"status": "ready"|"not ready", "checks": [{"name", "ok", "error"}]}. Errors name hosts,
// tables and missing versions, never passwords (pgx's connection errors omit them); serve the
// endpoint on an internal port.
func (r *Readiness) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	results, err := r.Check(req.Context())
	body := struct {
		Status string   `json:"status"`
		Checks []Result `json:"checks"`
	}{Status: "ready", Checks: results}
	code := http.StatusOK
	if err != nil {
		body.Status, code = "not ready", http.StatusServiceUnavailable
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(body)
}
