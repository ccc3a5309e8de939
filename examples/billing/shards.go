//go:build unix

package main

// -shards=N: the accounts split over N PostgreSQL databases, one consumer over all of them
// (inbox.Config.Stores with a store per database, inbox.Config.Route reading the shard the
// publisher wrote into each payment). Shard 0 is the database of INBOX_DATABASE_URL, which
// also holds the broker's tables (postgres broker), the rejection log and the receipts;
// shard k > 0 is the database <schema>_s<k>, created for the run on the same server. Every
// shard holds the run's schema with every account, the inbox and the outbox; a payment to
// account a is routed to shard a mod N, so at the end an account holds its payments on its own
// shard and 0 on every other.

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// shardField is the metadata field of a payment that names its shard ("0".."N-1"), written
// by the publisher from the account, once: every copy carries the same one.
const shardField = "shard"

// maxShards bounds -shards.
const maxShards = 8

// sharded reports whether the run splits its accounts over several databases.
func (o options) sharded() bool { return o.shards > 1 }

// checkShards refuses a -shards the rest of the command line cannot run with.
func checkShards(o options) error {
	switch {
	case o.shards < 0 || o.shards > maxShards:
		return fmt.Errorf("-shards=%d: want 0 (one database) to %d", o.shards, maxShards)
	case !o.sharded():
		return nil
	case o.db != dbPgx:
		return fmt.Errorf("-shards=%d runs on pgstore only (-db=pgx, the default), not -db=%s", o.shards, o.db)
	case o.mode != router.ModeImmediate:
		return fmt.Errorf("-shards=%d runs the immediate mode only: the demo does not split its store-then-process tables over the shards", o.shards)
	case o.soak:
		return fmt.Errorf("-shards=%d runs the scripted crashes only, not -soak", o.shards)
	}
	return nil
}

// shardOf returns the shard of an account: account mod n.
func shardOf(account int64, n int) int { return int(account % int64(n)) }

// shardDatabase returns the database name of shard k > 0 of the run whose schema is schema.
func shardDatabase(schema string, k int) string { return schema + "_s" + strconv.Itoa(k) }

// shardURL returns INBOX_DATABASE_URL with its database replaced by shard k's (k > 0).
func shardURL(schema string, k int) (string, error) {
	u, err := url.Parse(databaseURL())
	if err != nil {
		return "", errors.New("parse INBOX_DATABASE_URL: invalid URL")
	}
	u.Path = "/" + shardDatabase(schema, k)
	return u.String(), nil
}

// closeAll closes every storage of sts.
func closeAll(sts []*storage) {
	for _, st := range sts {
		st.close()
	}
}

// openShards opens shards 1..N-1 of the run (shard 0 is the storage the caller opened); none
// without -shards.
func openShards(ctx context.Context, o options, schema, appName string, maxConns int32) ([]*storage, error) {
	var out []*storage
	for k := 1; k < o.shards; k++ {
		u, err := shardURL(schema, k)
		if err == nil {
			var st *storage
			if st, err = openStorageAt(ctx, u, o.db, schema, appName, maxConns, false); err == nil {
				out = append(out, st)
				continue
			}
		}
		closeAll(out)
		return nil, fmt.Errorf("shard %d: %w", k, err)
	}
	return out, nil
}

// shardedInbox sets the billing inbox's stores on cfg: Store with one database, or with
// -shards a store per shard (shard 0 is main's) and the route from shardField.
func shardedInbox(cfg inbox.Config, main *storage, shards []*storage) (inbox.Config, error) {
	if len(shards) == 0 {
		cfg.Store = main.store
		return cfg, nil
	}
	route, err := inbox.RouteFromMetadata(shardField)
	if err != nil {
		return cfg, err
	}
	cfg.Stores = map[string]inbox.Store{"0": main.store}
	for k, st := range shards {
		cfg.Stores[strconv.Itoa(k+1)] = st.store
	}
	cfg.Route = route
	return cfg, nil
}

// tagShards writes each message's shard into its metadata (the publisher's part of the route).
func (w *workload) tagShards(n int) {
	accountOf := make(map[string]int64, len(w.ids))
	for i, id := range w.ids {
		accountOf[id] = w.accountOf[i]
	}
	tag := func(msgs []*message.Message) {
		for _, m := range msgs {
			a, ok := accountOf[m.UUID]
			if !ok {
				a = w.frozenAccount // a poison payment
			}
			m.Metadata.Set(shardField, strconv.Itoa(shardOf(a, n)))
		}
	}
	tag(w.deliveries)
	tag(w.poison)
}

// dbs returns the run's databases: d.st, then the shards.
func (d *demo) dbs() []*storage { return append([]*storage{d.st}, d.shards...) }

// storageOf returns the database of an account.
func (d *demo) storageOf(account int64) *storage {
	if !d.o.sharded() {
		return d.st
	}
	return d.dbs()[shardOf(account, d.o.shards)]
}

// createShards creates the databases of shards 1..N-1 on the server of d.st, opens them and
// sets each up as d.setup does d.st's.
func (d *demo) createShards(ctx context.Context) error {
	for k := 1; k < d.o.shards; k++ {
		name := shardDatabase(d.schema, k)
		if _, err := d.pool.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
			return fmt.Errorf("create database of shard %d: %w", k, err)
		}
		d.shardDBs = append(d.shardDBs, name)
	}
	shards, err := openShards(ctx, d.o, d.schema, "billing-demo-"+d.runID+"-orchestrator", 4)
	if err != nil {
		return err
	}
	d.shards = shards
	for k, st := range shards {
		if err := st.setup(ctx, d.accounts, d.rejections, d.receipts, d.o.accounts); err != nil {
			return fmt.Errorf("shard %d: %w", k+1, err)
		}
	}
	fmt.Fprintf(d.out, "shards      %d databases (shard 0: the default one; %s): every account in each, a payment to account a routed to shard a mod %d (metadata %q)\n",
		d.o.shards, fmt.Sprint(d.shardDBs), d.o.shards, shardField)
	return nil
}

// dropShards closes the shards' pools and drops their databases.
func (d *demo) dropShards(ctx context.Context) error {
	closeAll(d.shards)
	d.shards = nil
	for _, name := range d.shardDBs {
		if _, err := d.pool.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			return fmt.Errorf("drop database %s: %w", name, err)
		}
	}
	d.shardDBs = nil
	return nil
}
