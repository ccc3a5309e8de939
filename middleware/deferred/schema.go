package deferred

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/migrate"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migration is one versioned schema change, rendered for a configured schema and table.
type Migration struct {
	// Version is the migration's number, from its file name.
	Version int
	// Name is the file name, e.g. "0001_create_deferred_inbox.sql".
	Name string
	// SQL is the statement text with quoted identifiers substituted.
	SQL string
}

// names holds the quoted identifiers and the SQL built from them for one table.
type names struct {
	schema, table       string // unquoted
	qtable              string // quoted
	channel             string // the NOTIFY channel (unquoted)
	tmpl                map[string]string
	receiveSQL          string
	conflictSQL         string
	claimSQL            string
	countSQL, lockSQL   string
	doneSQL, failSQL    string
	releaseSQL, reapSQL string
	statsSQL, replaySQL string
}

// newNames validates nothing (Config.Validate did) and builds the SQL for cfg.
func newNames(cfg Config) *names {
	t := pgx.Identifier{cfg.Schema, cfg.Table}.Sanitize()
	idx := func(suffix string) string { return pgx.Identifier{cfg.Table + suffix}.Sanitize() }
	sum := sha256.Sum256([]byte(cfg.Schema + "." + cfg.Table))
	n := &names{
		schema: cfg.Schema, table: cfg.Table, qtable: t,
		// A channel name is an identifier (at most 63 bytes): a hash of schema and table
		// keeps it short and unique per table.
		channel: "watermill_inbox_deferred_" + hex.EncodeToString(sum[:8]),
		tmpl: map[string]string{
			"Table":            t,
			"FreeIndex":        idx("_free_idx"),
			"PredecessorIndex": idx("_predecessor_idx"),
			"SlotIndex":        idx("_sequence_key"),
			// Schema-qualified, for DROP INDEX (a bare name would follow the search_path).
			"QualifiedPredecessorIndex": pgx.Identifier{cfg.Schema, cfg.Table + "_predecessor_idx"}.Sanitize(),
			"UnfinishedIndex":           idx("_unfinished_idx"),
			"SequenceIndex":             idx("_sequence_idx"),
			"ProcessingIndex":           idx("_processing_idx"),
			"DeadIndex":                 idx("_dead_idx"),
			"DoneAtIndex":               idx("_done_at_idx"),
		},
	}
	n.receiveSQL = `WITH ins AS (
  INSERT INTO ` + t + ` (message_id, consumer_name, message_uuid, aggregate_key, producer_seq, topic, payload, payload_hash, metadata)
  VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
  ON CONFLICT DO NOTHING
  RETURNING id)
SELECT ins.id FROM ins`
	// The row an insert conflicted with: its key's row first, else the row at its producer
	// sequence ($3, $4: NULL without one).
	n.conflictSQL = "SELECT payload_hash, message_id = $1 FROM " + t +
		" WHERE consumer_name = $2 AND (message_id = $1 OR (aggregate_key = $3 AND producer_seq = $4 AND producer_seq IS NOT NULL))" +
		" ORDER BY message_id = $1 DESC LIMIT 1"

	// The claim (see docs/store-then-process.md, "The claim"): a skip scan over the aggregates
	// that have unfinished rows, starting after a cursor ($5, the last aggregate key the
	// worker's previous claim reached, so every aggregate gets its turn), takes each one's head
	// row (the first unfinished row in the aggregate's order); a head that is pending, due, and
	// whose aggregate has no row in processing is a candidate. Rows without an aggregate are
	// candidates in arrival order. The candidates are locked FOR UPDATE SKIP LOCKED, rechecked
	// as pending, and set processing. The candidates are looked up as an array by primary key
	// (= ANY (ARRAY(...))), not as an IN (subquery) semi join: on a table without statistics
	// (new, or not yet analyzed) the planner estimated a few rows in all and joined the
	// candidates against a sequential scan and sort of the whole table on every claim.
	unfinished := "e.status <> 'done'"
	if cfg.AfterDead == ContinueAggregate {
		unfinished = "e.status IN ('pending', 'processing')"
	}
	headOrder, headCols, headCheck := "e.id", "e.id, e.status, e.next_attempt_at", ""
	if cfg.Ordering == OrderProducerSequence {
		headOrder = "e.producer_seq, e.id"
		headCols += ", e.producer_seq"
		headCheck = `
    AND (h.producer_seq = ` + strconv.FormatInt(cfg.FirstSequence, 10) + ` OR EXISTS (
      SELECT 1 FROM ` + t + ` q
      WHERE q.consumer_name = $1 AND q.aggregate_key = a.k AND q.producer_seq IS NOT NULL
        AND q.producer_seq = h.producer_seq - 1))`
	}
	seqFilter := ""
	if cfg.Ordering == OrderProducerSequence {
		seqFilter = " AND e.producer_seq IS NOT NULL"
	}
	// Stuck aggregates (Stats): the claim's skip scan from the first aggregate, each one's head,
	// counted when it is pending, or dead and holding pending rows, and was received more than
	// $2 seconds ago.
	stuckSQL := `(WITH RECURSIVE aggs(k) AS (
    (SELECT e.aggregate_key FROM ` + t + ` e
     WHERE e.consumer_name = $1 AND e.status <> 'done' AND e.aggregate_key IS NOT NULL
     ORDER BY e.aggregate_key LIMIT 1)
    UNION ALL
    SELECT (SELECT e.aggregate_key FROM ` + t + ` e
            WHERE e.consumer_name = $1 AND e.status <> 'done' AND e.aggregate_key IS NOT NULL AND e.aggregate_key > a.k
            ORDER BY e.aggregate_key LIMIT 1)
    FROM aggs a WHERE a.k IS NOT NULL)
  SELECT count(*) FROM aggs a
  CROSS JOIN LATERAL (
    SELECT e.status, e.received_at FROM ` + t + ` e
    WHERE e.consumer_name = $1 AND e.aggregate_key = a.k AND ` + unfinished + seqFilter + `
    ORDER BY ` + headOrder + ` LIMIT 1) h
  WHERE a.k IS NOT NULL AND h.received_at < now() - make_interval(secs => $2::float8)
    AND (h.status = 'pending' OR h.status = 'dead' AND EXISTS (
      SELECT 1 FROM ` + t + ` p WHERE p.consumer_name = $1 AND p.aggregate_key = a.k AND p.status = 'pending')))`
	n.claimSQL = `WITH RECURSIVE aggs(k) AS (
  (SELECT e.aggregate_key FROM ` + t + ` e
   WHERE e.consumer_name = $1 AND e.status <> 'done' AND e.aggregate_key IS NOT NULL AND e.aggregate_key > $5
   ORDER BY e.aggregate_key LIMIT 1)
  UNION ALL
  SELECT (SELECT e.aggregate_key FROM ` + t + ` e
          WHERE e.consumer_name = $1 AND e.status <> 'done' AND e.aggregate_key IS NOT NULL AND e.aggregate_key > a.k
          ORDER BY e.aggregate_key LIMIT 1)
  FROM aggs a WHERE a.k IS NOT NULL),
heads AS (
  SELECT h.id, a.k FROM aggs a
  CROSS JOIN LATERAL (
    SELECT ` + headCols + ` FROM ` + t + ` e
    WHERE e.consumer_name = $1 AND e.aggregate_key = a.k AND ` + unfinished + seqFilter + `
    ORDER BY ` + headOrder + ` LIMIT 1) h
  WHERE a.k IS NOT NULL AND h.status = 'pending' AND h.next_attempt_at <= now()
    AND NOT EXISTS (
      SELECT 1 FROM ` + t + ` p
      WHERE p.consumer_name = $1 AND p.aggregate_key = a.k AND p.status = 'processing')` + headCheck + `
  LIMIT $2),
cand AS (
  SELECT id FROM heads
  UNION ALL
  (SELECT e.id FROM ` + t + ` e
   WHERE e.consumer_name = $1 AND e.status = 'pending' AND e.aggregate_key IS NULL AND e.next_attempt_at <= now()
   ORDER BY e.id LIMIT $2)),
c AS (
  SELECT r.id FROM ` + t + ` r
  WHERE r.id = ANY (ARRAY(SELECT id FROM cand)) AND r.status = 'pending' AND r.next_attempt_at <= now()
  ORDER BY r.id LIMIT $2
  FOR UPDATE OF r SKIP LOCKED)
UPDATE ` + t + ` t SET status = 'processing', claimed_at = now(), claimed_by = $3, claim_token = $4
FROM c WHERE t.id = c.id
RETURNING t.id, t.message_id, t.message_uuid, t.aggregate_key, t.topic,
  octet_length(t.payload)::bigint + octet_length(t.metadata::text), t.received_at`

	n.countSQL = "UPDATE " + t + " SET attempts = attempts + 1, claimed_at = now(), claimed_by = $3" +
		" WHERE id = $1 AND claim_token = $2 AND status = 'processing' RETURNING attempts"
	n.lockSQL = "SELECT payload, metadata FROM " + t + " WHERE id = $1 AND claim_token = $2 AND status = 'processing' FOR UPDATE"
	// Fails (division_by_zero) when the token no longer matches, aborting the transaction.
	n.doneSQL = "WITH u AS (UPDATE " + t + " SET status = 'done', done_at = now(), claim_token = NULL, last_error = NULL" +
		" WHERE id = $1 AND claim_token = $2 AND status = 'processing' RETURNING 1)" +
		" SELECT 1 / (SELECT count(*)::int FROM u)"
	// $3: dead; $4: delay in seconds; $5: last error; $6: attempts delta.
	n.failSQL = "UPDATE " + t + " SET status = CASE WHEN $3::boolean THEN 'dead' ELSE 'pending' END," +
		" dead_at = CASE WHEN $3::boolean THEN now() END," +
		" next_attempt_at = now() + make_interval(secs => $4::float8)," +
		" last_error = coalesce($5::text, last_error), attempts = attempts + $6::int," +
		" claim_token = NULL, claimed_by = NULL, claimed_at = NULL" +
		" WHERE id = $1 AND claim_token = $2 AND status = 'processing' RETURNING attempts"
	// $1, $2: the rows' ids and their claims' tokens, pairwise.
	n.releaseSQL = "UPDATE " + t + " t SET status = 'pending', claim_token = NULL, claimed_by = NULL, claimed_at = NULL" +
		" FROM unnest($1::bigint[], $2::uuid[]) AS r(id, token)" +
		" WHERE t.id = r.id AND t.claim_token = r.token AND t.status = 'processing'"
	// Rows whose transaction is open are locked: SKIP LOCKED leaves them to their worker.
	n.reapSQL = `UPDATE ` + t + ` t SET status = 'pending', claim_token = NULL, claimed_by = NULL, claimed_at = NULL, next_attempt_at = now()
FROM (SELECT id FROM ` + t + `
      WHERE consumer_name = $1 AND status = 'processing' AND claimed_at < now() - make_interval(secs => $2::float8)
      LIMIT 1000 FOR UPDATE SKIP LOCKED) s
WHERE t.id = s.id`
	n.statsSQL = `SELECT
  (SELECT count(*) FROM ` + t + ` WHERE consumer_name = $1 AND status = 'pending' AND aggregate_key IS NULL) +
  (SELECT count(*) FROM ` + t + ` WHERE consumer_name = $1 AND status <> 'done' AND aggregate_key IS NOT NULL AND status = 'pending'),
  least((SELECT min(received_at) FROM ` + t + ` WHERE consumer_name = $1 AND status = 'pending' AND aggregate_key IS NULL),
        (SELECT min(received_at) FROM ` + t + ` WHERE consumer_name = $1 AND status <> 'done' AND aggregate_key IS NOT NULL AND status = 'pending')),
  (SELECT count(*) FROM ` + t + ` WHERE consumer_name = $1 AND status = 'processing'),
  (SELECT count(*) FROM ` + t + ` WHERE consumer_name = $1 AND status = 'dead'),
  ` + stuckSQL + `,
  now()`
	n.replaySQL = `WITH r AS (
  UPDATE ` + t + ` SET status = 'pending', attempts = 0, next_attempt_at = now(), done_at = NULL, dead_at = NULL,
    claim_token = NULL, claimed_by = NULL, claimed_at = NULL, last_error = NULL
  WHERE consumer_name = $1 AND status = ANY($2::text[])
    AND ($3::text[] IS NULL OR message_id = ANY($3::text[]))
    AND ($4::timestamptz IS NULL OR received_at >= $4)
    AND ($5::timestamptz IS NULL OR received_at < $5)
  RETURNING 1)
SELECT count(*), pg_notify($6, $1::text)::text FROM r`
	return n
}

// migrations is the table's set for the shared runner (internal/migrate): its files rendered
// for its names, recorded under its quoted table, checked for the table and the version table.
func (n *names) migrations() migrate.Set {
	return migrate.Set{
		Prefix: "deferred",
		Files:  migrationFiles,
		Dir:    "migrations",
		Data:   n.tmpl,
		Schema: n.schema,
		Table:  n.qtable,
		Tables: []string{n.qtable},
	}
}

// Migrations returns the migrations in version order, rendered for the inbox's schema and
// table.
func (i *Inbox) Migrations() ([]Migration, error) {
	ms, err := i.n.migrations().Migrations()
	if err != nil {
		return nil, err
	}
	return migrate.Converted[Migration](ms), nil
}

// MigrationSQL returns every migration as one script, for users who run their own migration
// tool: it creates the schema when missing and records each version, so a later Migrate does
// nothing.
func (i *Inbox) MigrationSQL() (string, error) { return i.n.migrationSQL() }

// MigrationSQL returns the migration script for cfg without a database connection (cfg.Pool
// may be nil), or an error wrapping inbox.ErrInvalidConfig for invalid names.
func MigrationSQL(cfg Config) (string, error) {
	cfg.setDefaults()
	if cfg.Pool == nil {
		cfg.Pool = &pgxpool.Pool{} // only names are used
	}
	if cfg.ConsumerName == "" {
		cfg.ConsumerName = "migration"
	}
	if err := cfg.Validate(); err != nil {
		return "", err
	}
	return newNames(cfg).migrationSQL()
}

func (n *names) migrationSQL() (string, error) {
	return n.migrations().Script("watermill-inbox store-then-process schema")
}

// Migrate first checks, reading only, whether anything is pending (CheckSchema); when nothing
// is, it returns having written nothing and taken no lock, so an application role without
// CREATE may call it at start-up. Otherwise it applies the pending migrations in one
// transaction under a transaction-level advisory lock (pg_advisory_xact_lock, the key pgstore
// takes too, so the two never migrate one schema at the same moment), so several instances
// starting at once apply each migration once. It creates the schema when missing (needing
// CREATE on the database only then). It returns the versions applied (none when current), or
// the first error, after which nothing is applied.
func (i *Inbox) Migrate(ctx context.Context) (applied []int, err error) {
	applied, _, err = i.n.migrations().Apply(ctx, i.cfg.Pool, nil)
	return applied, err
}

// ErrSchemaNotCurrent is wrapped by every *SchemaError: errors.Is(err, ErrSchemaNotCurrent)
// tells a schema that needs migrating from a database that cannot be reached.
var ErrSchemaNotCurrent = errors.New("deferred: the store-then-process schema is not current")

// SchemaError is CheckSchema's answer when the schema needs migrating: the tables that do not
// exist and the migrations not recorded as applied. Run Migrate (or the script of
// MigrationSQL, or `watermill-inbox deferred migrate`) as a role that may create tables, then
// check again.
type SchemaError struct {
	// Table is the quoted table checked, e.g. "public"."inbox_deferred".
	Table string
	// Missing lists the quoted tables that do not exist (or that the role cannot see): the
	// table, then the version table "<schema>".watermill_inbox_migrations.
	Missing []string
	// Pending lists the migrations not recorded as applied, by file name, e.g.
	// "0001_create_deferred_inbox.sql".
	Pending []string
}

func (e *SchemaError) Error() string {
	return migrate.Describe("deferred", e.Table, e.Missing, e.Pending,
		"run Migrate or `watermill-inbox deferred migrate` as the schema's owner")
}

// Unwrap returns ErrSchemaNotCurrent.
func (e *SchemaError) Unwrap() error { return ErrSchemaNotCurrent }

// CheckSchema reports whether the schema is current, reading only (no DDL, no lock): nil when
// the table and the version table exist and every migration is recorded as applied; a
// *SchemaError (wrapping ErrSchemaNotCurrent) naming what is missing or pending; or the
// database's error, wrapped ("deferred: check schema: ..."). It needs USAGE on the schema and
// SELECT on the version table only, so it serves as a readiness probe (health.Schema) and as
// the start-up check of a role that cannot create tables.
func (i *Inbox) CheckSchema(ctx context.Context) error {
	st, err := i.n.migrations().Check(ctx, i.cfg.Pool)
	if err != nil {
		return err
	}
	if st.Current() {
		return nil
	}
	return &SchemaError{Table: i.n.qtable, Missing: st.Missing, Pending: st.PendingNames()}
}
