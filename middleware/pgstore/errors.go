package pgstore

import (
	"errors"
	"fmt"

	"github.com/watermill-inbox/watermill-inbox/internal/purge"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// The errors of package pgstore. Test for them with errors.Is; a database error is pgx's
// *pgconn.PgError, wrapped with the failing step.
var (
	// ErrKeyNotUUID: a key that is not a canonical lowercase UUID, claimed on a store with
	// LayoutCompact. It also wraps inbox.ErrInvalidKey.
	ErrKeyNotUUID = errors.New("pgstore: key is not a canonical lowercase UUID (compact layout)")
	// ErrKeyNotUUIDv7: a key that is not a canonical lowercase UUIDv7, claimed on a store
	// partitioned with ProducerTimeFromKey. It also wraps inbox.ErrInvalidKey.
	ErrKeyNotUUIDv7 = errors.New("pgstore: key is not a canonical lowercase UUIDv7 (partitioned by key time)")
	// ErrNoProducerTime: partitioned mode without a stable producer time (at New: no
	// Partitioning.ProducerTime; at a claim with ProducerTimeFromClaim: no producer time).
	ErrNoProducerTime = errors.New("pgstore: no stable producer time for partitioned mode")
	// ErrNoPartition: the partition for a claim's producer time does not exist (PostgreSQL
	// SQLSTATE 23514, "no partition of relation ... found for row"). Nothing was claimed; the
	// delivery is nacked. Create it as the table's owner: `watermill-inbox partitions ensure`
	// from cron, or a PartitionManager on the owner's pool (docs/retention.md).
	ErrNoPartition = errors.New("pgstore: no partition for the message's producer time")

	// ErrSchemaNotCurrent is wrapped by every *SchemaError: errors.Is(err, ErrSchemaNotCurrent)
	// tells a schema that needs migrating from a database that cannot be reached.
	ErrSchemaNotCurrent = errors.New("pgstore: the inbox schema is not current")

	// ErrTxOwnedByInbox is returned by Commit and Rollback of the transaction TxFromContext hands a
	// handler: the inbox ends it after the handler returns. The call also makes the delivery fail
	// with inbox.ErrTxEnded (nacked, and counted as the message's failure), since a handler that
	// meant to end its transaction cannot have its work committed.
	ErrTxOwnedByInbox = errors.New("pgstore: the inbox transaction is the inbox's to end")

	// ErrClaimInFlight is wrapped by a claim's error when its key stayed claimed by another
	// delivery until the claim's context ended (the inbox's ClaimTimeout) or, with
	// Config.LockTimeout set, past LockTimeout. The claim held no pool connection while it waited
	// and counted nothing: the inbox nacks it without using up an attempt, and the redelivery is
	// a duplicate once the delivery in flight commits. The error also wraps the context's error.
	ErrClaimInFlight = errors.New("pgstore: key claimed by a delivery in flight")

	// ErrWaitingForConnection is wrapped by a claim's error when its context ended while it
	// waited for a pool connection (every connection in use: size pgxpool's pool_max_conns to the
	// subscriber's concurrency plus a few). The error also wraps the context's error and says
	// how long it waited and how many connections the pool has.
	ErrWaitingForConnection = errors.New("pgstore: waiting for a pool connection")

	// ErrNoTable is returned by DetectLayout when the inbox table does not exist.
	ErrNoTable = errors.New("pgstore: the inbox table does not exist")

	// ErrNotPartitioned is returned by the partition methods of a store without
	// Config.Partitioning. It wraps inbox.ErrInvalidConfig.
	ErrNotPartitioned = fmt.Errorf("%w: pgstore: the store is not in partitioned mode (Config.Partitioning)", inbox.ErrInvalidConfig)

	// ErrPartitionOwner is returned, wrapping PostgreSQL's error (SQLSTATE 42501,
	// insufficient_privilege), by EnsurePartitions, DropPartitions and PartitionManager rounds
	// run by a role that does not own the inbox table: creating, attaching, detaching and
	// dropping a partition need the parent table's owner (PostgreSQL's ALTER TABLE ... ATTACH
	// PARTITION and DROP TABLE), which no GRANT gives. Run `watermill-inbox partitions ensure`
	// and `partitions drop` as the owner (from cron), or a PartitionManager on a pool connected
	// as the owner; see docs/retention.md.
	ErrPartitionOwner = errors.New("pgstore: partition maintenance needs the table's owner")

	// ErrPurgeInProgress is returned by PurgeExpired when another purger (another instance, or
	// the CLI) holds the table's purge lock: exactly one purger runs at a time per inbox table.
	ErrPurgeInProgress = purge.ErrInProgress

	// ErrNoRetention is returned (wrapping inbox.ErrInvalidConfig) by PurgeExpired on a Store
	// whose Config.Retention is not set: the purge never guesses a window.
	ErrNoRetention = fmt.Errorf("%w: pgstore: no retention window configured (Config.Retention)", inbox.ErrInvalidConfig)
)
