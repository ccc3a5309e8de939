package pgstore_test

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// uuid7 returns a canonical lowercase UUIDv7 whose timestamp is at (milliseconds) and whose
// other bits are derived from name, so the same name and time give the same ID.
func uuid7(name string, at time.Time) string {
	var b [16]byte
	sum := sha256.Sum256([]byte(name))
	copy(b[:], sum[:16])
	ms := uint64(at.UnixMilli())
	binary.BigEndian.PutUint16(b[4:6], uint16(ms))
	binary.BigEndian.PutUint32(b[0:4], uint32(ms>>16))
	b[6] = 0x70 | b[6]&0x0f
	b[8] = 0x80 | b[8]&0x3f
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// layoutStore returns a migrated store of cfg in a fresh schema.
func layoutStore(t *testing.T, conns int32, cfg pgstore.Config) (*pgstore.Store, *testenv.Schema) {
	t.Helper()
	sch := testenv.NewSchema(t, conns)
	cfg.Schema = sch.Name
	s, err := pgstore.New(sch.Pool, cfg)
	if err != nil {
		t.Fatalf("pgstore.New(%+v): %v", cfg, err)
	}
	if _, err := s.Migrate(context.Background()); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	return s, sch
}

// uuidKeys runs a store under the conformance suite, whose keys are names ("m-1"): it maps
// every name to a UUIDv7 at a fixed time and sets that time as the producer time, the way
// the inbox would for messages with UUIDv7 IDs.
type uuidKeys struct {
	*pgstore.Store
	at time.Time
}

func (u uuidKeys) key(k contract.Key) contract.Key {
	k.MessageID = uuid7(k.MessageID, u.at)
	return k
}

func (u uuidKeys) delivery(d contract.Delivery) contract.Delivery {
	d.Key, d.ProducerTime = u.key(d.Key), u.at
	return d
}

func (u uuidKeys) Check(d contract.Delivery) error { return u.Store.Check(u.delivery(d)) }

func (u uuidKeys) Claim(ctx context.Context, d contract.Delivery) (contract.Tx, contract.Claim, error) {
	return u.Store.Claim(ctx, u.delivery(d))
}

func (u uuidKeys) ClaimBatch(ctx context.Context, ds []contract.Delivery) (contract.BatchTx, []contract.Claim, error) {
	ds = slices.Clone(ds)
	for k := range ds {
		ds[k] = u.delivery(ds[k])
	}
	// The batch is sorted by key, as the inbox sorts it; the mapped keys sort otherwise.
	order := make([]int, len(ds))
	for k := range order {
		order[k] = k
	}
	slices.SortFunc(order, func(a, b int) int { return strings.Compare(ds[a].Key.MessageID, ds[b].Key.MessageID) })
	sorted := make([]contract.Delivery, len(ds))
	for k, o := range order {
		sorted[k] = ds[o]
	}
	bt, cs, err := u.Store.ClaimBatch(ctx, sorted)
	if err != nil {
		return nil, nil, err
	}
	out := make([]contract.Claim, len(cs))
	pos := make([]int, len(ds)) // the original index's position in sorted
	for k, o := range order {
		out[o] = cs[k]
		pos[o] = k
	}
	return batchIndex{bt, pos}, out, nil
}

// batchIndex maps the members of a batch uuidKeys sorted back to the caller's indexes.
type batchIndex struct {
	contract.BatchTx
	pos []int
}

func (b batchIndex) Drop(ctx context.Context, member int, f contract.Failure) (int, error) {
	return b.BatchTx.Drop(ctx, b.pos[member], f)
}

func (u uuidKeys) MarkDeadLettered(ctx context.Context, k contract.Key, reason string) error {
	return u.Store.MarkDeadLettered(ctx, u.key(k), reason)
}

func (u uuidKeys) Replay(ctx context.Context, k contract.Key) (bool, error) {
	return u.Store.Replay(ctx, u.key(k))
}

// TestConformanceLayouts runs the storetest suite, its group-commit cases (Batch/...)
// included, on every new layout and mode: the compact layout, partitioned by the timestamp of
// UUIDv7 keys (text layout), and compact partitioned by a producer time the claim carries.
func TestConformanceLayouts(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  pgstore.Config
	}{
		{"Compact", pgstore.Config{Layout: pgstore.LayoutCompact}},
		{"PartitionedFromKey", pgstore.Config{Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}}},
		{"CompactPartitionedFromClaim", pgstore.Config{Layout: pgstore.LayoutCompact,
			Partitioning: &pgstore.Partitioning{Interval: pgstore.PartitionHourly, ProducerTime: pgstore.ProducerTimeFromClaim}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			at := time.Now().Truncate(time.Millisecond)
			storetest.Run(t, storetest.Harness{
				New: func(t *testing.T) contract.Store {
					s, _ := layoutStore(t, 8, tc.cfg)
					return track(t, uuidKeys{Store: s, at: at})
				},
				Record: readRecord,
			})
		})
	}
}

// TestCompactRefusesOtherKeys: the compact layout claims only canonical lowercase UUIDs; any
// other key is refused before anything is written, with ErrKeyNotUUID (and inbox.ErrInvalidKey),
// and through the inbox it is an invalid key: the handler does not run.
func TestCompactRefusesOtherKeys(t *testing.T) {
	s, sch := layoutStore(t, 4, pgstore.Config{Layout: pgstore.LayoutCompact})
	ctx := context.Background()
	for _, id := range []string{"order-42", "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11", "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",
		"a0eebc999c0b4ef8bb6d6bb9bd380a11", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a1", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a1g"} {
		for _, d := range []contract.Delivery{plain(id, "c"), countedFirst(plain(id, "c"), true)} {
			if err := s.Check(d); !errors.Is(err, pgstore.ErrKeyNotUUID) || !errors.Is(err, inbox.ErrInvalidKey) {
				t.Fatalf("Check(%q) on the compact layout: %v; want ErrKeyNotUUID", id, err)
			}
			tx, _, err := s.Claim(ctx, d)
			if tx != nil || !errors.Is(err, pgstore.ErrKeyNotUUID) || !errors.Is(err, inbox.ErrInvalidKey) {
				t.Fatalf("Claim(%q) on the compact layout: tx %v, err %v; want ErrKeyNotUUID", id, tx, err)
			}
			bt, _, err := s.ClaimBatch(ctx, []contract.Delivery{d})
			if bt != nil || !errors.Is(err, pgstore.ErrKeyNotUUID) {
				t.Fatalf("ClaimBatch(%q) on the compact layout: %v; want ErrKeyNotUUID", id, err)
			}
		}
		if rows, records := rowsAndRecords(t, sch.Pool, s); rows+records != 0 {
			t.Fatalf("refused keys left %d rows and %d attempt records", rows, records)
		}
	}
	ib, err := inbox.New(inbox.Config{Store: s, ConsumerName: "billing", InvalidKeyBrake: inbox.InvalidKeyBrake{Disabled: true}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	h := ib.Middleware(func(*message.Message) ([]*message.Message, error) { ran++; return nil, nil })
	msg := message.NewMessage("not-a-uuid", []byte("{}"))
	msg.SetContext(ctx)
	if _, err := h(msg); !errors.Is(err, inbox.ErrInvalidKey) || !inbox.IsPermanent(err) || !strings.Contains(strings.ToLower(err.Error()), "uuid") {
		t.Fatalf("inbox on a compact store, key not a UUID: %v; want a permanent invalid-key error naming UUIDs", err)
	}
	good := message.NewMessage(uuid7("good", time.Now()), []byte("{}"))
	good.SetContext(ctx)
	if _, err := h(good); err != nil {
		t.Fatalf("UUID key: %v", err)
	}
	var rows int
	if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+s.Table()).Scan(&rows); err != nil || rows != 1 || ran != 1 {
		t.Fatalf("rows %d (err %v), handler runs %d; want only the UUID message, once", rows, err, ran)
	}
	// The consumer name is stored once, as a smallint.
	var names int
	if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+s.ConsumersTable()+" WHERE consumer_name = 'billing'").Scan(&names); err != nil || names != 1 {
		t.Fatalf("consumers table: %d rows for billing, err %v", names, err)
	}
}

// TestPartitionedModeNeedsAProducerTime: without a producer-time source New refuses the
// store, naming both options; an inbox on a store that takes the time from the claim refuses
// a Config without ProducerTime; a message without one is an invalid key.
func TestPartitionedModeNeedsAProducerTime(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	_, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Partitioning: &pgstore.Partitioning{}})
	if !errors.Is(err, pgstore.ErrNoProducerTime) || !errors.Is(err, inbox.ErrInvalidConfig) ||
		!strings.Contains(err.Error(), "ProducerTimeFromKey") || !strings.Contains(err.Error(), "ProducerTimeFromClaim") {
		t.Fatalf("New, partitioned without a producer time: %v", err)
	}
	s, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromClaim}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := inbox.New(inbox.Config{Store: s, ConsumerName: "c"}, nil); !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "ProducerTime") {
		t.Fatalf("inbox.New without ProducerTime on a store partitioned by claim time: %v", err)
	}
	if err := s.Check(plain("m", "c")); !errors.Is(err, pgstore.ErrNoProducerTime) {
		t.Fatalf("Check without a producer time: %v", err)
	}
	if !s.NeedsProducerTime() {
		t.Fatal("a store partitioned by claim time does not say it needs a producer time")
	}
	// Through the inbox: a message without a producer time, or with an unreadable one, is an
	// invalid key; the handler does not run and nothing is written.
	if _, err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{Store: s, ConsumerName: "c", InvalidKeyBrake: inbox.InvalidKeyBrake{Disabled: true},
		ProducerTime: func(m *message.Message) (time.Time, bool, error) {
			switch v := m.Metadata.Get("produced_at"); v {
			case "":
				return time.Time{}, false, nil
			case "garbage":
				return time.Time{}, false, errors.New("not a time")
			default:
				ts, err := time.Parse(time.RFC3339Nano, v)
				return ts, err == nil, err
			}
		}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ran := 0
	h := ib.Middleware(func(*message.Message) ([]*message.Message, error) { ran++; return nil, nil })
	for _, v := range []string{"", "garbage"} {
		msg := message.NewMessage(uuid7("m-"+v, time.Now()), []byte("{}"))
		msg.Metadata.Set("produced_at", v)
		msg.SetContext(context.Background())
		if _, err := h(msg); !errors.Is(err, inbox.ErrInvalidKey) || !inbox.IsPermanent(err) {
			t.Fatalf("produced_at %q: %v; want a permanent invalid-key error", v, err)
		}
	}
	var rows int
	if err := sch.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+s.Table()).Scan(&rows); err != nil || rows != 0 || ran != 0 {
		t.Fatalf("rows %d (err %v), handler runs %d; want none", rows, err, ran)
	}
	k, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name, Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}})
	if err != nil {
		t.Fatal(err)
	}
	v4 := "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
	if err := k.Check(plain(v4, "c")); !errors.Is(err, pgstore.ErrKeyNotUUIDv7) {
		t.Fatalf("Check of a UUIDv4 on a store partitioned by key time: %v", err)
	}
	if k.NeedsProducerTime() {
		t.Fatal("a store partitioned by key time says it needs a producer time")
	}
}

// partitionOf returns the partition holding the claim of id, or "" when there is none.
func partitionOf(t *testing.T, sch *testenv.Schema, s *pgstore.Store, id string) string {
	t.Helper()
	var name string
	err := sch.Pool.QueryRow(context.Background(), "SELECT tableoid::regclass::text FROM "+s.Table()+" WHERE message_id = $1", id).Scan(&name)
	if err != nil && !strings.Contains(err.Error(), "no rows") {
		t.Fatal(err)
	}
	return name
}

// TestPartitionRollover drives the producer time across an hourly partition boundary: a
// message produced 1 ms before the boundary is processed, then redelivered (the wall clock
// has moved on; its producer time has not): it is a duplicate, the handler ran once and its
// claim sits in the partition before the boundary. A message produced at the boundary lands
// in the next partition. Both producer-time sources.
func TestPartitionRollover(t *testing.T) {
	for _, src := range []pgstore.ProducerTimeSource{pgstore.ProducerTimeFromKey, pgstore.ProducerTimeFromClaim} {
		t.Run(map[pgstore.ProducerTimeSource]string{pgstore.ProducerTimeFromKey: "FromKey", pgstore.ProducerTimeFromClaim: "FromMetadata"}[src], func(t *testing.T) {
			s, sch := layoutStore(t, 4, pgstore.Config{Layout: pgstore.LayoutCompact,
				Partitioning: &pgstore.Partitioning{Interval: pgstore.PartitionHourly, ProducerTime: src}})
			ctx := context.Background()
			boundary := pgstore.PeriodOf(time.Now(), pgstore.PartitionHourly).Add(5 * time.Hour)
			if _, err := s.EnsurePartitions(ctx, boundary.Add(-time.Hour), boundary); err != nil {
				t.Fatal(err)
			}
			sch.CreateAccounts(t, 1)
			cfg := inbox.Config{Store: s, ConsumerName: "billing"}
			if src == pgstore.ProducerTimeFromClaim {
				cfg.ProducerTime = func(m *message.Message) (time.Time, bool, error) {
					v := m.Metadata.Get("produced_at")
					if v == "" {
						return time.Time{}, false, nil
					}
					ts, err := time.Parse(time.RFC3339Nano, v)
					return ts, err == nil, err
				}
			}
			ib, err := inbox.New(cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			h := ib.Middleware(func(m *message.Message) ([]*message.Message, error) {
				tx, _ := pgstore.TxFromContext(m.Context())
				_, err := tx.Exec(m.Context(), "UPDATE accounts SET balance = balance + 100 WHERE id = 1")
				return nil, err
			})
			deliver := func(id string, produced time.Time) {
				t.Helper()
				msg := message.NewMessage(id, []byte(`{"amount":100}`))
				msg.Metadata.Set("produced_at", produced.Format(time.RFC3339Nano))
				msg.SetContext(ctx)
				if _, err := h(msg); err != nil {
					t.Fatalf("deliver %s: %v", id, err)
				}
			}
			before, after := boundary.Add(-time.Millisecond), boundary
			first := uuid7("first", before)
			deliver(first, before) // first delivery, just before the boundary
			deliver(first, before) // the redelivery: "now" is later, the producer time the same
			deliver(first, before)
			second := uuid7("second", after)
			deliver(second, after)
			var balance int64
			if err := sch.Pool.QueryRow(ctx, "SELECT balance FROM accounts WHERE id = 1").Scan(&balance); err != nil || balance != 200 {
				t.Fatalf("balance %d (err %v); want 200: two messages, each applied once", balance, err)
			}
			st := ib.Stats()
			if st.Processed != 2 || st.Duplicates != 2 {
				t.Fatalf("stats %+v; want 2 processed, 2 duplicates", st)
			}
			table := strings.Trim(strings.Split(s.Table(), ".")[1], `"`)
			if p := partitionOf(t, sch, s, first); p != table+"_p"+before.UTC().Format("2006010215") {
				t.Fatalf("first message in partition %q; want the hour before the boundary", p)
			}
			if p := partitionOf(t, sch, s, second); p != table+"_p"+after.UTC().Format("2006010215") {
				t.Fatalf("second message in partition %q; want the hour after the boundary", p)
			}
		})
	}
}

// TestConcurrentDuplicateAcrossBoundary: two copies of a message produced 1 ms before a
// partition boundary are claimed at once while a message produced at the boundary claims in
// the next partition: exactly one copy claims, the other waits for it and then sees a
// duplicate; the other partition is not blocked.
func TestConcurrentDuplicateAcrossBoundary(t *testing.T) {
	s, sch := layoutStore(t, 6, pgstore.Config{Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}})
	ctx := context.Background()
	boundary := pgstore.PeriodOf(time.Now(), pgstore.PartitionDaily).Add(24 * time.Hour)
	sch.CreateAccounts(t, 1)
	k := uuid7("copy", boundary.Add(-time.Millisecond))
	d := plain(k, "billing")
	first, _ := mustClaim(t, s, d, contract.Run)
	if _, err := handlerTx(t, first).Exec(ctx, "UPDATE accounts SET balance = balance + 100 WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	type result struct {
		c   contract.Claim
		err error
	}
	second := make(chan result, 1)
	go func() {
		cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		tx, c, err := s.Claim(cctx, d)
		release(tx)
		second <- result{c, err}
	}()
	// Across the boundary: not blocked by the open claim.
	mustCommit(t, s, plain(uuid7("other", boundary), "billing"))
	select {
	case r := <-second:
		t.Fatalf("the concurrent copy did not wait for the first claim: %+v", r)
	case <-time.After(300 * time.Millisecond):
	}
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-second
	if r.err != nil || r.c.Decision != contract.Duplicate {
		t.Fatalf("concurrent copy: %+v, err %v; want a duplicate", r.c, r.err)
	}
	var balance int64
	var rows int
	if err := sch.Pool.QueryRow(ctx, "SELECT (SELECT balance FROM accounts WHERE id = 1), (SELECT count(*) FROM "+s.Table()+")").Scan(&balance, &rows); err != nil {
		t.Fatal(err)
	}
	if balance != 100 || rows != 2 {
		t.Fatalf("balance %d, inbox rows %d; want 100 (one effect) and 2 rows", balance, rows)
	}
}

// TestMissingPartitionIsAClearError: a claim whose producer time has no partition fails with
// ErrNoPartition and leaves nothing behind; after EnsurePartitions the same claim succeeds.
func TestMissingPartitionIsAClearError(t *testing.T) {
	s, sch := layoutStore(t, 4, pgstore.Config{Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}})
	ctx := context.Background()
	far := time.Now().Add(30 * 24 * time.Hour)
	p := plain(uuid7("far", far), "c")
	for _, d := range []contract.Delivery{p, countedFirst(p, false), countedFirst(p, true)} {
		tx, _, err := s.Claim(ctx, d)
		if tx != nil || !errors.Is(err, pgstore.ErrNoPartition) || !strings.Contains(err.Error(), "partitions ensure") {
			t.Fatalf("claim without a partition: tx %v, err %v; want ErrNoPartition", tx, err)
		}
		bt, _, err := s.ClaimBatch(ctx, []contract.Delivery{d})
		if bt != nil || !errors.Is(err, pgstore.ErrNoPartition) {
			t.Fatalf("batch claim without a partition: %v; want ErrNoPartition", err)
		}
	}
	if rows, attempts := rowsAndRecords(t, sch.Pool, s); rows+attempts != 0 {
		t.Fatalf("after failed claims: %d rows, %d attempt records; want none", rows, attempts)
	}
	if _, err := s.EnsurePartitions(ctx, far, far); err != nil {
		t.Fatal(err)
	}
	mustCommit(t, s, countedFirst(p, true))
	if rows, attempts := rowsAndRecords(t, sch.Pool, s); rows != 1 || attempts != 0 {
		t.Fatalf("after the claim: %d rows, %d attempt records; want 1 and 0", rows, attempts)
	}
}

// TestPartitionManager: RunOnce creates partitions from now minus the retention window to
// now plus the lead, and, once the clock has moved past the window, detaches and drops the
// expired ones with their rows while recent rows stay; Run and Close stop cleanly.
func TestPartitionManager(t *testing.T) {
	s, sch := layoutStore(t, 4, pgstore.Config{Layout: pgstore.LayoutCompact,
		Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}})
	ctx := context.Background()
	now := time.Now()
	clock := now
	m, err := pgstore.NewPartitionManager(s, pgstore.PartitionManagerConfig{Retention: 3 * 24 * time.Hour, Lead: 48 * time.Hour,
		Now: func() time.Time { return clock }}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.RunOnce(ctx); err != nil {
		t.Fatal(err)
	}
	parts, err := s.Partitions(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if first, last := parts[0].From, parts[len(parts)-1].From; len(parts) != 6 ||
		!first.Equal(pgstore.PeriodOf(now.Add(-72*time.Hour), pgstore.PartitionDaily)) || !last.Equal(pgstore.PeriodOf(now.Add(48*time.Hour), pgstore.PartitionDaily)) {
		t.Fatalf("partitions after the first round: %+v; want the days from now-3d to now+2d", parts)
	}
	claim := func(name string, at time.Time) { mustCommit(t, s, plain(uuid7(name, at), "c")) }
	claim("old", now.Add(-72*time.Hour))
	claim("recent", now.Add(47*time.Hour)) // two days old four days from now
	// Four days later, the partition of the old message ended more than 3 days ago.
	clock = now.Add(4 * 24 * time.Hour)
	r, err := m.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	oldPart := strings.Trim(strings.Split(s.Table(), ".")[1], `"`) + "_p" + now.Add(-72*time.Hour).UTC().Format("20060102")
	if len(r.Dropped) == 0 || r.Dropped[0] != oldPart || len(r.Created) == 0 {
		t.Fatalf("round four days later: %+v; want %s dropped first and new partitions ahead", r, oldPart)
	}
	var rows int
	var oldLeft bool
	if err := sch.Pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+s.Table()+"), to_regclass($1) IS NOT NULL", sch.Name+"."+oldPart).Scan(&rows, &oldLeft); err != nil {
		t.Fatal(err)
	}
	if rows != 1 || oldLeft {
		t.Fatalf("after the drop: %d rows (want the recent 1), old partition still there: %v", rows, oldLeft)
	}
	// Run and Close.
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	var runErr error
	wg.Go(func() { runErr = m.Run(rctx) })
	time.Sleep(100 * time.Millisecond)
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if runErr != nil {
		t.Fatalf("Run: %v", runErr)
	}
	if _, err := pgstore.NewPartitionManager(s, pgstore.PartitionManagerConfig{}, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("NewPartitionManager without Retention: %v", err)
	}
}

// TestMigrateRefusesAnotherLayout: a compact or partitioned store on an existing text-layout
// table is refused, naming the conversion, and the table is left as it was.
func TestMigrateRefusesAnotherLayout(t *testing.T) {
	sch := testenv.NewSchema(t, 2)
	text := sch.Store(t)
	for _, cfg := range []pgstore.Config{
		{Schema: sch.Name, Layout: pgstore.LayoutCompact},
		{Schema: sch.Name, Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}},
	} {
		s, err := pgstore.New(sch.Pool, cfg)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Migrate(context.Background()); !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "LayoutMigrationSQL") {
			t.Fatalf("Migrate %+v over a text table: %v", cfg, err)
		}
	}
	mustCommit(t, text, plain("order-1", "c")) // the text table still claims text keys
	if n := claimRows(t, sch.Pool, text, "order-1"); n != 1 {
		t.Fatalf("%d rows of order-1, want 1", n)
	}
}

// TestLayoutMigrationSQL converts a text-layout table holding processed messages into each
// new layout and mode: every row is there afterwards (duplicates of the old messages are
// still caught, with their payload hashes), the table claims new messages, and a table with
// a key the new layout cannot hold is refused with nothing changed.
func TestLayoutMigrationSQL(t *testing.T) {
	ctx := context.Background()
	for _, to := range []pgstore.Config{
		{Layout: pgstore.LayoutCompact},
		{Layout: pgstore.LayoutCompact, Partitioning: &pgstore.Partitioning{Interval: pgstore.PartitionHourly, ProducerTime: pgstore.ProducerTimeFromKey}},
		{Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}},
	} {
		sch := testenv.NewSchema(t, 2)
		text := sch.Store(t)
		to.Schema = sch.Name
		ids := []string{uuid7("a", time.Now().Add(-50*time.Hour)), uuid7("b", time.Now()), uuid7("c", time.Now().Add(-2*time.Hour))}
		hash := sha256.Sum256([]byte("payload"))
		withHash := func(id string, h []byte) contract.Delivery {
			d := plain(id, "billing")
			d.PayloadHash, d.ProducerTime = h, time.Now()
			return d
		}
		for _, id := range ids {
			mustCommit(t, text, withHash(id, hash[:]))
		}
		script, err := pgstore.LayoutMigrationSQL(pgstore.Config{Schema: sch.Name}, to)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := sch.Pool.Exec(ctx, script); err != nil {
			t.Fatalf("conversion to %+v: %v\n%s", to, err, script)
		}
		s, err := pgstore.New(sch.Pool, to)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Migrate(ctx); err != nil {
			t.Fatalf("Migrate after the conversion: %v", err)
		}
		// Duplicates of the old messages are caught with their payload hashes: the same
		// payload is a duplicate, another one a collision.
		for _, id := range ids {
			mustClaim(t, s, withHash(id, hash[:]), contract.Duplicate)
			mustClaim(t, s, withHash(id, payloadHash("another payload")), contract.Collision)
		}
		mustCommit(t, s, withHash(uuid7("new", time.Now()), hash[:]))
		var n int
		if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+s.Table()).Scan(&n); err != nil || n != 4 {
			t.Fatalf("converted %+v: %d rows, err %v; want 4", to, n, err)
		}
	}
	// A key the compact layout cannot hold: refused, nothing changed.
	sch := testenv.NewSchema(t, 2)
	text := sch.Store(t)
	mustCommit(t, text, plain("order-7", "billing"))
	script, err := pgstore.LayoutMigrationSQL(pgstore.Config{Schema: sch.Name}, pgstore.Config{Schema: sch.Name, Layout: pgstore.LayoutCompact})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sch.Pool.Exec(ctx, script); err == nil || !strings.Contains(err.Error(), "not a canonical lowercase UUID") {
		t.Fatalf("conversion of a table with a text key: %v", err)
	}
	_, _ = sch.Pool.Exec(ctx, "ROLLBACK")
	var n int
	if err := sch.Pool.QueryRow(ctx, "SELECT count(*) FROM "+text.Table()+" WHERE message_id = 'order-7'").Scan(&n); err != nil || n != 1 {
		t.Fatalf("after the refused conversion: %d rows, err %v", n, err)
	}
	if _, err := pgstore.LayoutMigrationSQL(pgstore.Config{}, pgstore.Config{Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromClaim}}); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("conversion to ProducerTimeFromClaim: %v", err)
	}
}

// TestPartitionMaintenanceDoesNotBlockClaims: with an inbox transaction open (a slow
// handler), creating a partition completes without waiting for it, and while a drop waits for
// that transaction (DETACH ... CONCURRENTLY waits for transactions that may see the partition),
// new claims still go through at once; the drop completes after the slow one commits.
func TestPartitionMaintenanceDoesNotBlockClaims(t *testing.T) {
	s, sch := layoutStore(t, 6, pgstore.Config{Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}})
	ctx := context.Background()
	today := pgstore.PeriodOf(time.Now(), pgstore.PartitionDaily)
	old := today.Add(-5 * 24 * time.Hour)
	if _, err := s.EnsurePartitions(ctx, old, old); err != nil {
		t.Fatal(err)
	}
	claim := func(name string, at time.Time) contract.Tx {
		t.Helper()
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		tx, c, err := s.Claim(cctx, plain(uuid7(name, at), "c"))
		if err != nil || c.Decision != contract.Run {
			t.Fatalf("claim %s while maintenance runs: %+v %v", name, c, err)
		}
		return tx
	}
	slow := claim("slow", today)
	ectx, cancel := context.WithTimeout(ctx, 2*time.Second)
	created, err := s.EnsurePartitions(ectx, today.Add(10*24*time.Hour), today.Add(10*24*time.Hour))
	cancel()
	if err != nil || len(created) != 1 {
		t.Fatalf("EnsurePartitions with an inbox transaction open: %v %v; want it created without waiting", created, err)
	}
	dropped := make(chan error, 1)
	go func() {
		_, err := s.DropPartitions(ctx, old.Add(24*time.Hour))
		dropped <- err
	}()
	time.Sleep(200 * time.Millisecond)
	if err := claim("during-drop", today).Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := slow.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-dropped:
		if err != nil {
			t.Fatalf("DropPartitions: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("DropPartitions did not finish after the open transaction committed")
	}
	var rows int
	var gone bool
	if err := sch.Pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM "+s.Table()+"), to_regclass($1) IS NULL", sch.Name+".inbox_processed_messages_p"+old.Format("20060102")).Scan(&rows, &gone); err != nil || rows != 2 || !gone {
		t.Fatalf("after: %d rows (want 2), old partition gone %v, err %v", rows, gone, err)
	}
}

// TestMigrationCompactRowV2: a compact table created before migration 0003 (received_at
// timestamptz, a 4-byte hash prefix), holding rows, plain and partitioned, is converted by
// Migrate in place: every row is still there, each old message is still caught as a
// duplicate with the first 2 bytes of its hash (another payload under its key is still told
// apart), the time received is kept to the minute (Stats), a row takes 24 bytes of data
// (plus 8 for the period when partitioned), new claims work, and a second Migrate does nothing.
func TestMigrationCompactRowV2(t *testing.T) {
	ctx := context.Background()
	for _, cfg := range []pgstore.Config{
		{Layout: pgstore.LayoutCompact},
		{Layout: pgstore.LayoutCompact, Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}},
	} {
		v1 := newFirstVersionCompact(t, cfg)
		s, sch, now := v1.s, v1.sch, v1.now
		var ids []string
		hashOf := func(i int) [32]byte { return sha256.Sum256([]byte("payload-" + string(rune('a'+i)))) }
		for i := range 3 {
			id := uuid7("v1-"+string(rune('a'+i)), now)
			ids = append(ids, id)
			h := hashOf(i)
			v1.insert(t, id, h, "now() - $4::interval", []string{"5 hours", "1 hour", "0 seconds"}[i])
		}
		applied, err := s.Migrate(ctx)
		if err != nil || len(applied) == 0 || applied[0] != 3 || len(applied) != latestMigration(t, s)-2 {
			t.Fatalf("Migrate over a first-version compact table: applied %v, %v; want 3 to %d", applied, err, latestMigration(t, s))
		}
		var rows, width int
		if err := sch.Pool.QueryRow(ctx, "SELECT count(*), max(pg_column_size(t.*)) FROM "+s.Table()+" t").Scan(&rows, &width); err != nil {
			t.Fatal(err)
		}
		wantWidth := 24 + 24 // tuple header, data
		if cfg.Partitioning != nil {
			wantWidth += 8
		}
		if rows != 3 || width != wantWidth {
			t.Fatalf("after 0003: %d rows of %d bytes; want 3 of %d", rows, width, wantWidth)
		}
		for i, id := range ids {
			h := hashOf(i)
			d := plain(id, "billing")
			d.PayloadHash, d.ProducerTime = h[:], now
			mustClaim(t, s, d, contract.Duplicate)
			// The stored hash is the first 2 bytes of the old row's 4-byte prefix.
			var stored int16
			if err := sch.Pool.QueryRow(ctx, "SELECT payload_hash FROM "+s.Table()+" WHERE message_id = $1::uuid", id).Scan(&stored); err != nil ||
				uint16(stored) != binary.BigEndian.Uint16(h[:2]) {
				t.Fatalf("old message %d after 0003: stored hash %04x (%v), want %x", i, uint16(stored), err, h[:2])
			}
			other := hashOf(i + 1)
			if string(other[:2]) == string(h[:2]) {
				t.Fatalf("test payloads %d and %d share a 2-byte prefix: pick others", i, i+1)
			}
			d.PayloadHash = other[:]
			mustClaim(t, s, d, contract.Collision) // another payload under key i is told apart
		}
		st, err := s.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Rows != 3 || st.Oldest == nil || st.Newest == nil ||
			time.Since(*st.Oldest) < 5*time.Hour-time.Minute || time.Since(*st.Oldest) > 5*time.Hour+2*time.Minute ||
			time.Since(*st.Newest) > 2*time.Minute {
			t.Fatalf("stats after 0003: %d rows, oldest %v, newest %v; want 3, about 5 hours ago and now", st.Rows, st.Oldest, st.Newest)
		}
		newer := plain(uuid7("v2-new", now), "billing")
		newer.ProducerTime = now
		mustCommit(t, s, newer)
		var recent bool
		if err := sch.Pool.QueryRow(ctx, "SELECT abs(received_minute - floor(extract(epoch FROM now()) / 60)) <= 1 FROM "+s.Table()+" WHERE message_id = $1::uuid", uuid7("v2-new", now)).Scan(&recent); err != nil || !recent {
			t.Fatalf("the new row's received_minute is not this minute (%v, %v)", recent, err)
		}
		if again, err := s.Migrate(ctx); err != nil || len(again) != 0 {
			t.Fatalf("second Migrate: %v, %v", again, err)
		}
	}
}

// firstVersionCompact is a compact table (cfg: plain or partitioned) as it was before
// migration 0003 (received_at timestamptz, a 4-byte hash prefix), created by the printed
// migration script up to 0003, with today's partition and the consumer "billing" registered.
type firstVersionCompact struct {
	s        *pgstore.Store
	sch      *testenv.Schema
	consumer int16
	now      time.Time
}

func newFirstVersionCompact(t *testing.T, cfg pgstore.Config) firstVersionCompact {
	t.Helper()
	ctx := context.Background()
	sch := testenv.NewSchema(t, 2)
	cfg.Schema = sch.Name
	s, err := pgstore.New(sch.Pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	script, err := s.MigrationSQL()
	if err != nil {
		t.Fatal(err)
	}
	cut := strings.Index(script, "\n-- 0003_")
	if cut < 0 {
		t.Fatalf("no migration 0003 in the script:\n%s", script)
	}
	sch.Exec(t, script[:cut]+"\nCOMMIT;")
	v := firstVersionCompact{s: s, sch: sch, now: time.Now()}
	if cfg.Partitioning != nil {
		if _, err := s.EnsurePartitions(ctx, v.now, v.now); err != nil {
			t.Fatal(err)
		}
	}
	if err := sch.Pool.QueryRow(ctx, "INSERT INTO "+s.ConsumersTable()+" (consumer_name) VALUES ('billing') RETURNING consumer_id").Scan(&v.consumer); err != nil {
		t.Fatal(err)
	}
	return v
}

// insert adds a first-version row of message id with hash's 4-byte prefix, received at the SQL
// expression received over $4 = at (in today's partition when partitioned).
func (v firstVersionCompact) insert(t *testing.T, id string, hash [32]byte, received string, at any) {
	t.Helper()
	cols, vals := "message_id, consumer_id, payload_hash, received_at", "$1::uuid, $2, $3, "+received
	args := []any{id, v.consumer, int32(binary.BigEndian.Uint32(hash[:4])), at}
	if v.s.Partitioned() {
		cols, vals, args = cols+", period", vals+", $5", append(args, pgstore.PeriodOf(v.now, pgstore.PartitionDaily))
	}
	v.sch.Exec(t, "INSERT INTO "+v.s.Table()+" ("+cols+") VALUES ("+vals+")", args...)
}

// latestMigration is the version of s's last migration.
func latestMigration(t *testing.T, s *pgstore.Store) int {
	t.Helper()
	ms, err := s.Migrations()
	if err != nil || len(ms) == 0 {
		t.Fatalf("migrations: %v", err)
	}
	return ms[len(ms)-1].Version
}
