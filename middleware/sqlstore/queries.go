package sqlstore

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"embed"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"
	"text/template"
	"time"

	"github.com/jackc/pgx/v5"
)

// The store's statements, one per file in queries/<dialect>/, each readable in one look.
// They are text/template files over the store's quoted names (queryNames): identifiers are
// substituted already validated (internal/ident) and quoted, never taken from a message.
// Parameters are named (@message_id) and turned into the dialect's placeholders ($1, or ?
// repeated per occurrence) once, when the store is built.
//
//go:embed queries/postgres/*.sql queries/mysql/*.sql
var queryFiles embed.FS

// dialect is what differs between the databases, besides the SQL files.
type dialect struct {
	name string // the queries/ and migrations/ folder
	// positional: PostgreSQL's $n (each name once); else ? per occurrence.
	positional bool
	// sessionLock: the key's lock is a session-level GET_LOCK taken before BEGIN (MySQL);
	// else a transaction-level advisory lock tried in the claim statement (PostgreSQL).
	sessionLock bool
	quote       func(string) string
}

var dialects = map[Dialect]*dialect{
	PostgreSQL: {name: "postgres", positional: true, quote: func(n string) string { return pgx.Identifier{n}.Sanitize() }},
	MySQL:      {name: "mysql", sessionLock: true, quote: func(n string) string { return "`" + strings.ReplaceAll(n, "`", "``") + "`" }},
}

// qualify quotes schema.name (name alone when schema is empty).
func (d *dialect) qualify(schema, name string) string {
	if schema == "" {
		return d.quote(name)
	}
	return d.quote(schema) + "." + d.quote(name)
}

// queryNames are what the query templates see: quoted names.
type queryNames struct {
	Table, Attempts string
}

// query is one rendered statement: its SQL with placeholders and its parameters in order.
type query struct {
	sql    string
	params []string
}

// paramRE matches @name parameters, and @@system variables, which stay as they are.
var paramRE = regexp.MustCompile(`@@?[a-z_]+`)

func renderQuery(d *dialect, name string, n queryNames) query {
	tmpl := template.Must(template.New("").ParseFS(queryFiles, "queries/"+d.name+"/*.sql"))
	if tmpl.Lookup(name+".sql") == nil {
		return query{} // not a statement of this dialect
	}
	var b strings.Builder
	if err := tmpl.ExecuteTemplate(&b, name+".sql", n); err != nil {
		panic(fmt.Sprintf("sqlstore: query %s/%s: %v", d.name, name, err)) // a bug in an embedded file
	}
	var lines []string // without the comment lines, which may name a parameter
	for _, l := range strings.Split(b.String(), "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "--") && strings.TrimSpace(l) != "" {
			lines = append(lines, l)
		}
	}
	var q query
	index := map[string]int{}
	q.sql = paramRE.ReplaceAllStringFunc(strings.Join(lines, "\n"), func(m string) string {
		if strings.HasPrefix(m, "@@") {
			return m
		}
		p := m[1:]
		if !d.positional {
			q.params = append(q.params, p)
			return "?"
		}
		k, ok := index[p]
		if !ok {
			q.params = append(q.params, p)
			k = len(q.params)
			index[p] = k
		}
		return fmt.Sprintf("$%d", k)
	})
	return q
}

// queryArgs holds every parameter a statement may name.
type queryArgs struct {
	messageID, consumerName    any // text (consumerName: NULL in purge for every consumer)
	messageType, correlationID any // text or NULL
	payloadHash                []byte
	lockName                   string
	delta, attempts            int
	lastError, reason          any // text or NULL
	before                     time.Time
	ageMicros                  int64 // now - before, for MySQL's DATETIME
	batchSize                  int64
}

func keyArgs(k keyT) *queryArgs {
	return &queryArgs{messageID: k.MessageID, consumerName: k.ConsumerName}
}

// args returns a's values in q's parameter order.
func (q query) args(a *queryArgs) []any {
	out := make([]any, len(q.params))
	for k, p := range q.params {
		switch p {
		case "message_id":
			out[k] = a.messageID
		case "consumer_name":
			out[k] = a.consumerName
		case "message_type":
			out[k] = a.messageType
		case "correlation_id":
			out[k] = a.correlationID
		case "payload_hash":
			out[k] = a.payloadHash
		case "lock_name":
			out[k] = a.lockName
		case "delta":
			out[k] = a.delta
		case "attempts":
			out[k] = a.attempts
		case "last_error":
			out[k] = a.lastError
		case "reason":
			out[k] = a.reason
		case "before":
			out[k] = a.before
		case "age_micros":
			out[k] = a.ageMicros
		case "batch_size":
			out[k] = a.batchSize
		default:
			panic("sqlstore: unknown query parameter @" + p) // a bug in an embedded file
		}
	}
	return out
}

// execer is a *sql.DB, *sql.Conn or *sql.Tx.
type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

func (q query) exec(ctx context.Context, e execer, a *queryArgs) (sql.Result, error) {
	return e.ExecContext(ctx, q.sql, q.args(a)...)
}

func (q query) row(ctx context.Context, e execer, a *queryArgs) *sql.Row {
	return e.QueryRowContext(ctx, q.sql, q.args(a)...)
}

// queries are the store's statements, rendered once for its dialect and names. A statement
// the dialect does not have (getLock on PostgreSQL, asyncCommit on MySQL) is empty.
type queries struct {
	claim, storedHash, record, clearProcessed, count, asyncCommit query
	countFailure, recordForUpdate, settleUpdate, settleDelete     query
	markDeadLettered, replay, dropClaim, purge                    query
	getLock, releaseLock, inTransaction                           query
}

func newQueries(d *dialect, n queryNames) queries {
	r := func(name string) query { return renderQuery(d, name, n) }
	return queries{
		claim: r("claim"), storedHash: r("stored_hash"), record: r("record"), clearProcessed: r("clear_processed"),
		count: r("count"), asyncCommit: r("async_commit"), countFailure: r("count_failure"),
		recordForUpdate: r("record_for_update"), settleUpdate: r("settle_update"), settleDelete: r("settle_delete"),
		markDeadLettered: r("mark_dead_lettered"), replay: r("replay"), dropClaim: r("drop_claim"), purge: r("purge"),
		getLock: r("get_lock"), releaseLock: r("release_lock"), inTransaction: r("in_transaction"),
	}
}

// lockName is the name of k's lock: on PostgreSQL the text hashed (hashtextextended) into the
// advisory lock; on MySQL a GET_LOCK name, which is server-wide and at most 64 characters:
// "wi:" and 60 hex digits of the SHA-256 of the store's names and k. Two keys whose names
// collide would only share a lock (one waits in process while the other is in flight).
func (s *Store) lockName(k keyT) string {
	full := s.lockBase + "\x1f" + k.ConsumerName + "\x1f" + k.MessageID
	if !s.d.sessionLock {
		return full
	}
	h := sha256.Sum256([]byte(full))
	return "wi:" + hex.EncodeToString(h[:30])
}
