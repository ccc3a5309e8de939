// Package sqlstore is the inbox's store over database/sql, for services whose data layer is
// database/sql (sqlx, sqlc's database/sql output, GORM, ent, bun): the handler gets the inbox
// transaction as a *sql.Tx. Two dialects: PostgreSQL through pgx's stdlib driver, and
// MySQL/MariaDB through github.com/go-sql-driver/mysql. It implements the same storage
// contract as pgstore and passes the same conformance suite (internal/storetest), unchanged,
// on both databases.
//
//	db, _ := sqlstore.Open(ctx, sqlstore.MySQL, "app:secret@tcp(db:3306)/app")
//	db.SetMaxOpenConns(16) // the subscriber's concurrency plus a few
//	store, _ := sqlstore.New(db, sqlstore.Config{Dialect: sqlstore.MySQL})
//	_, _ = store.Migrate(ctx)
//	ib, _ := inbox.New(inbox.Config{Store: store, ConsumerName: "billing"}, logger)
//	h := router.AddConsumerHandler("billing", "payments", sub, func(msg *message.Message) error {
//		tx, _ := sqlstore.TxFromContext(msg.Context())
//		_, err := tx.ExecContext(msg.Context(), "UPDATE accounts SET balance = balance + ? WHERE id = ?", 10, 1)
//		return err
//	})
//	h.AddMiddleware(ib.Middleware)
//
// The statements are in queries/<dialect>/*.sql and the migrations in
// migrations/<dialect>/*.sql, one statement per file. What each store and dialect supports
// (pgstore's compact layout, partitions and store-then-process; the outbox on PostgreSQL only) is in
// docs/stores.md.
//
// # MySQL and MariaDB
//
// The claim is insert-first, as on PostgreSQL, but MySQL has no transaction-level advisory
// lock and no ON CONFLICT DO NOTHING, so three choices differ.
//
// The insert. INSERT IGNORE turns every error of the statement into a warning, not only the
// duplicate key (warning 1062): a key longer than its column is truncated (warning 1265 or
// 1406) and an invalid byte sequence mangled (1366), so two distinct keys could be stored as
// one and the second message silently skipped. INSERT ... ON DUPLICATE KEY UPDATE
// message_id = message_id (queries/mysql/claim.sql) raises those as errors and reports a
// duplicate as 0 rows affected with no warning; it needs UPDATE on the table (GrantSQL) and
// a connection without CLIENT_FOUND_ROWS (Open refuses it). Under InnoDB a duplicate check
// takes a lock on the existing index record (shared for INSERT IGNORE, exclusive for ON
// DUPLICATE KEY UPDATE, next-key under REPEATABLE READ): a copy of a message whose first
// delivery has not committed would wait on the server, holding its connection, and the
// three-transaction duplicate-insert pattern can deadlock (1213). Neither happens here,
// because of the key's lock: no two claims of one key run at once.
//
// The key's lock (flood protection). GET_LOCK is session-level, not transaction-level: the
// claim tries GET_LOCK(name, 0) on its connection before BEGIN (queries/mysql/get_lock.sql),
// never waiting, and releases it with RELEASE_LOCK after COMMIT or ROLLBACK. It replaces
// pg_try_advisory_xact_lock: a copy of a key in flight finds the lock taken, returns its
// connection and waits in process (claimwait.go), so a flood of copies of one message holds
// no connections. A connection whose lock could not be released is closed, never returned
// to the pool; the server releases a dead session's locks. The name is a hash of the
// database, table and key ("wi:" and 60 hex digits; GET_LOCK names are server-wide and at
// most 64 characters).
//
// The key columns are VARBINARY: byte for byte, so two keys that differ only in case or in
// trailing spaces stay two keys. utf8mb4_bin, like every utf8mb4 collation of MariaDB 10.11
// but the _nopad_ ones, is PAD SPACE: 'a' and 'a ' are one key under it. Keys that are not
// valid UTF-8, hold NUL or are longer than the columns (512 and 128 bytes) are refused before
// the server with ErrKeyNotStorable.
//
// sql.LevelDefault is READ COMMITTED on both dialects (MySQL's own default is REPEATABLE
// READ). Errors 1213 (deadlock, the transaction rolled back) and 1205 (lock wait timeout:
// only the statement rolled back; the inbox rolls the rest back before it retries), 1020 and
// 3101 are Retryable; missing privileges, tables, databases and refused logins are
// ConfigFaults (Store.Classify). Durable attempts and dead letters follow PostgreSQL's rule:
// counted after the claim by the claim's holder, grouped (count.go), the record read after
// the claim, a failure recorded on a second connection before the rollback. Purge deletes in
// bounded batches (DELETE ... ORDER BY received_at LIMIT n), each its own transaction.
//
// A *sql.Tx cannot refuse Commit or Rollback: see TxFromContext for how the store detects a
// handler that ended the inbox transaction (on MySQL, SELECT @@in_transaction before COMMIT,
// one round trip; MariaDB 10.3 and later).
package sqlstore
