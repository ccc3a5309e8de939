package pgstore_test

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// benchRows is INBOX_BENCH_ROWS, or def.
func benchRows(b *testing.B, def int) int {
	if v := os.Getenv("INBOX_BENCH_ROWS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 10_000 {
			b.Fatalf("INBOX_BENCH_ROWS=%q: want a number of rows, at least 10000", v)
		}
		return n
	}
	return def
}

// uuidV7SQL is a UUIDv7 (RFC 9562) built in SQL from the millisecond timestamp expression ms
// (PostgreSQL 15 has no uuidv7()): the random bits of gen_random_uuid, the version set to 7.
func uuidV7SQL(ms string) string {
	return "encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) placing substring(int8send((" + ms +
		")::bigint) from 3) from 1 for 6), 52, 1), 53, 1), 'hex')::uuid"
}

// tableBytes returns the heap and index bytes of table and its partitions.
func tableBytes(b *testing.B, sch *testenv.Schema, table string) (heap, index int64) {
	b.Helper()
	err := sch.Pool.QueryRow(context.Background(), `
		SELECT coalesce(sum(pg_relation_size(relid)), 0)::bigint, coalesce(sum(pg_indexes_size(relid)), 0)::bigint
		FROM (SELECT relid FROM pg_partition_tree($1::regclass) WHERE isleaf
		      UNION SELECT $1::regclass WHERE (SELECT relkind FROM pg_class WHERE oid = $1::regclass) = 'r') t`, table).Scan(&heap, &index)
	if err != nil {
		b.Fatal(err)
	}
	return heap, index
}

// BenchmarkBytesPerRow measures heap plus index bytes per retained row of each layout, on
// INBOX_BENCH_ROWS rows (default 1,000,000), as the claim writes them: the text layout with
// a 32-byte payload hash and a correlation ID (the router's CorrelationID middleware sets one
// on every message), and the compact layout with random (v4) and time-ordered (v7) UUID
// keys, plus the compact layout partitioned by day. Rows are inserted in batches of 10,000
// into the table with its indexes in place (so the B-trees split as they do in service),
// then VACUUM ANALYZE (autovacuum is off on these machines). One iteration measures every
// layout (the figures vary by well under 1% between runs):
//
//	go test ./middleware/pgstore -run '^$' -bench BytesPerRow -benchtime 1x
func BenchmarkBytesPerRow(b *testing.B) {
	rows := benchRows(b, 1_000_000)
	ctx := context.Background()
	for _, v := range []struct {
		name   string
		cfg    pgstore.Config
		insert string // columns and a SELECT over generate_series(1, $1) AS g producing them
	}{
		{"text-uuid4", pgstore.Config{},
			"(message_id, consumer_name, correlation_id, payload_hash) SELECT gen_random_uuid()::text, 'billing', gen_random_uuid()::text, sha256(int8send(g))"},
		{"compact-uuid4", pgstore.Config{Layout: pgstore.LayoutCompact},
			"(message_id, consumer_id, payload_hash) SELECT gen_random_uuid(), 1, (hashint8(g) >> 16)::smallint"},
		{"compact-uuid7", pgstore.Config{Layout: pgstore.LayoutCompact},
			"(message_id, consumer_id, payload_hash) SELECT " + uuidV7SQL("$2::bigint + g") + ", 1, (hashint8(g) >> 16)::smallint"},
		{"compact-partitioned-daily-uuid7", pgstore.Config{Layout: pgstore.LayoutCompact, Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}},
			"(message_id, consumer_id, payload_hash, period) SELECT " + uuidV7SQL("$2::bigint + g") + ", 1, (hashint8(g) >> 16)::smallint, $3::timestamptz"},
	} {
		b.Run(v.name, func(b *testing.B) {
			for range b.N {
				b.StopTimer()
				sch := testenv.NewSchema(b, 2)
				v.cfg.Schema = sch.Name
				s, err := pgstore.New(sch.Pool, v.cfg)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := s.Migrate(ctx); err != nil {
					b.Fatal(err)
				}
				if v.cfg.Layout == pgstore.LayoutCompact {
					sch.Exec(b, "INSERT INTO "+s.ConsumersTable()+" (consumer_id, consumer_name) VALUES (1, 'billing')")
				}
				period := pgstore.PeriodOf(time.Now(), pgstore.PartitionDaily)
				start := time.Now()
				const batch = 10_000
				for done := 0; done < rows; done += batch {
					q := "INSERT INTO " + s.Table() + " " + v.insert + " FROM generate_series($1::bigint + 1, $1::bigint + " + strconv.Itoa(batch) + ") AS g"
					args := []any{done}
					if v.cfg.Partitioning != nil {
						args = append(args, period.UnixMilli(), period)
					} else if v.name == "compact-uuid7" {
						args = append(args, period.UnixMilli())
					}
					if _, err := sch.Pool.Exec(ctx, q, args...); err != nil {
						b.Fatalf("insert: %v", err)
					}
				}
				load := time.Since(start)
				sch.Exec(b, "VACUUM ANALYZE "+s.Table())
				heap, index := tableBytes(b, sch, s.Table())
				b.ReportMetric(float64(heap+index)/float64(rows), "bytes/row")
				b.ReportMetric(float64(heap)/float64(rows), "heap-bytes/row")
				b.ReportMetric(float64(index)/float64(rows), "index-bytes/row")
				b.ReportMetric(load.Seconds(), "load-s")
				b.StartTimer()
			}
		})
	}
}

// BenchmarkPartitionDropVsDelete removes the same number of expired rows (INBOX_BENCH_ROWS,
// default 200,000) from a partitioned inbox table (text layout, daily) two ways: detaching
// (CONCURRENTLY) and dropping the partition that holds them (DropPartitions), and deleting
// them in batches of 5,000 ordered by received_at (Purge, the row-by-row way), followed by
// the VACUUM that the batched delete needs and the drop does not. Both partitions are filled
// identically beforehand. Three runs:
//
//	go test ./middleware/pgstore -run '^$' -bench PartitionDropVsDelete -benchtime 1x -count 3
func BenchmarkPartitionDropVsDelete(b *testing.B) {
	rows := benchRows(b, 200_000)
	ctx := context.Background()
	for range b.N {
		b.StopTimer()
		sch := testenv.NewSchema(b, 2)
		s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := s.Migrate(ctx); err != nil {
			b.Fatal(err)
		}
		today := pgstore.PeriodOf(time.Now(), pgstore.PartitionDaily)
		dropDay, deleteDay := today.Add(-20*24*time.Hour), today.Add(-10*24*time.Hour)
		if _, err := s.EnsurePartitions(ctx, dropDay, deleteDay); err != nil {
			b.Fatal(err)
		}
		for _, day := range []time.Time{dropDay, deleteDay} {
			for done := 0; done < rows; done += 10_000 {
				_, err := sch.Pool.Exec(ctx, "INSERT INTO "+s.Table()+" (message_id, consumer_name, received_at, period, correlation_id, payload_hash)"+
					" SELECT "+uuidV7SQL("$2::bigint + g")+"::text, 'billing', $3::timestamptz + g * interval '1 ms', $3, gen_random_uuid()::text, sha256(int8send(g))"+
					" FROM generate_series($1::bigint + 1, $1::bigint + least(10000, $4::bigint - $1::bigint)) AS g", done, day.UnixMilli(), day, rows)
				if err != nil {
					b.Fatal(err)
				}
			}
		}
		sch.Exec(b, "VACUUM ANALYZE "+s.Table())
		heapBefore, indexBefore := tableBytes(b, sch, s.Table())

		b.StartTimer()
		start := time.Now()
		dropped, err := s.DropPartitions(ctx, dropDay.Add(24*time.Hour))
		drop := time.Since(start)
		if err != nil || len(dropped) != 1 {
			b.Fatalf("drop: %v %v", dropped, err)
		}
		start = time.Now()
		res, err := s.Purge(ctx, pgstore.PurgeParams{Before: deleteDay.Add(24 * time.Hour), BatchSize: 5000})
		del := time.Since(start)
		if err != nil || res.Deleted != int64(rows) {
			b.Fatalf("batched delete: %+v %v; want %d rows", res, err, rows)
		}
		start = time.Now()
		sch.Exec(b, "VACUUM "+s.Table())
		vacuum := time.Since(start)
		b.StopTimer()

		var left int
		if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+s.Table()).Scan(&left); err != nil || left != 0 {
			b.Fatalf("rows left: %d %v", left, err)
		}
		b.ReportMetric(drop.Seconds(), "drop-s")
		b.ReportMetric(del.Seconds(), "batched-delete-s")
		b.ReportMetric(vacuum.Seconds(), "vacuum-after-delete-s")
		b.ReportMetric(float64(rows), "rows")
		b.ReportMetric(float64(heapBefore+indexBefore)/float64(2*rows), "bytes/row")
		b.StartTimer()
	}
}
