package pgstore

import (
	"embed"
	"fmt"
	"regexp"
	"strings"
	"text/template"
	"time"
)

// The store's statements, one per file in queries/, each readable in one look: the claim in
// queries/claim.sql, the counting in queries/count.sql, and so on. They are text/template
// files over the store's names and layout (queryNames): identifiers are substituted already
// validated (ValidateIdentifier) and quoted (pgx.Identifier), never taken from a message.
// Parameters are named (@message_id) and turned into positional ones ($1) once, when the
// store is built; a statement's arguments are then taken by name from a queryArgs.
//
// Why not sqlc (River's choice): sqlc generates Go from SQL against one fixed schema, and
// these statements are one text per layout (text or compact keys, plain or partitioned, in a
// schema and table the user names). A template per statement keeps the SQL in one file with
// its variants beside each other; sqlc would need a copy of every file per variant.
//
//go:embed queries/*.sql
var queryFiles embed.FS

var queryTemplates = template.Must(template.ParseFS(queryFiles, "queries/*.sql"))

// queryNames are what the templates see: quoted names and the layout.
type queryNames struct {
	Table, Attempts, Consumers string
	DuplicateAges              string // the duplicate-age histogram (migration 0005)
	Compact, Partitioned       bool
	Old                        string // the table a layout conversion copies from
	Session                    bool   // claim.sql: the key's lock for the session
}

// query is one rendered statement: its SQL with positional parameters and the names of its
// parameters in their order.
type query struct {
	sql    string
	params []string
}

var paramRE = regexp.MustCompile(`@([a-z_]+)`)

// renderQuery renders the template file name (without .sql) for n.
func renderQuery(name string, n queryNames) query {
	var b strings.Builder
	if err := queryTemplates.ExecuteTemplate(&b, name+".sql", n); err != nil {
		panic(fmt.Sprintf("pgstore: query %s: %v", name, err)) // a bug in an embedded file
	}
	var q query
	index := map[string]int{}
	q.sql = paramRE.ReplaceAllStringFunc(b.String(), func(m string) string {
		p := m[1:]
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
	messageID, consumerName    string
	messageType, correlationID any // text or NULL
	payloadHash                any // bytea, or the compact layout's smallint
	period                     time.Time
	lockKey                    string
	delta                      int32
	lastError, reason          any // text or NULL
	messageIDs, consumerNames  []string
	countToken                 int64
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
		case "period":
			out[k] = a.period
		case "lock_key":
			out[k] = a.lockKey
		case "delta":
			out[k] = a.delta
		case "last_error":
			out[k] = a.lastError
		case "reason":
			out[k] = a.reason
		case "message_ids":
			out[k] = a.messageIDs
		case "consumer_names":
			out[k] = a.consumerNames
		case "count_token":
			out[k] = a.countToken
		default:
			panic("pgstore: unknown query parameter @" + p) // a bug in an embedded file
		}
	}
	return out
}

// queries are the store's statements, rendered once for its names and layout.
type queries struct {
	claim, record, storedHash, count, clearProcessed query
	countFailure, settleCount, markDeadLettered      query
	replay, dropClaim, registerConsumer              query
	clearProcessedAsync, countFirst, unlock          query
	unlockIfHeld, takeBackLost, clearCounted         query
	duplicateAge, duplicateAges, claimSession        query
	lockSession                                      query
}

func newQueries(n queryNames) queries {
	return queries{
		claim:               renderQuery("claim", n),
		record:              renderQuery("record", n),
		storedHash:          renderQuery("stored_hash", n),
		count:               renderQuery("count", n),
		clearProcessed:      renderQuery("clear_processed", n),
		clearProcessedAsync: renderQuery("clear_processed_async", n),
		countFirst:          renderQuery("count_first", n),
		unlock:              renderQuery("unlock", n),
		unlockIfHeld:        renderQuery("unlock_if_held", n),
		takeBackLost:        renderQuery("take_back_lost", n),
		clearCounted:        renderQuery("clear_counted", n),
		claimSession:        renderQuery("claim", withSession(n)),
		lockSession:         renderQuery("lock_session", n),
		countFailure:        renderQuery("count_failure", n),
		settleCount:         renderQuery("settle_count", n),
		markDeadLettered:    renderQuery("mark_dead_lettered", n),
		replay:              renderQuery("replay", n),
		dropClaim:           renderQuery("drop_claim", n),
		registerConsumer:    renderQuery("register_consumer", n),
		duplicateAge:        renderQuery("duplicate_age", n),
		duplicateAges:       renderQuery("duplicate_ages", n),
	}
}

// withSession is n for claim.sql's session-lock variant.
func withSession(n queryNames) queryNames {
	n.Session = true
	return n
}
