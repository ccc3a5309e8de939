package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// storeLayout is one layout and mode of the pgstore inbox table.
type storeLayout struct {
	name string
	cfg  pgstore.Config
}

// storeLayouts are every layout and mode: the batched mode's tests run on each.
var storeLayouts = []storeLayout{
	{"text", pgstore.Config{}},
	{"compact", pgstore.Config{Layout: pgstore.LayoutCompact}},
	{"partitioned", pgstore.Config{Partitioning: &pgstore.Partitioning{ProducerTime: pgstore.ProducerTimeFromKey}}},
	{"compact-partitioned", pgstore.Config{Layout: pgstore.LayoutCompact, Partitioning: &pgstore.Partitioning{Interval: pgstore.PartitionHourly, ProducerTime: pgstore.ProducerTimeFromKey}}},
}

// forEachLayout runs f as a subtest per layout.
func forEachLayout(t *testing.T, f func(t *testing.T, l storeLayout)) {
	for _, l := range storeLayouts {
		t.Run(l.name, func(t *testing.T) { f(t, l) })
	}
}

// newLayoutEnv is newEnv on an inbox table of layout l. Outside the text layout the tests'
// message UUIDs (names such as "pay-1") are mapped to UUIDv7 keys (layoutKey), through the
// inbox's KeyExtractor, so the tests read as they do on the text layout.
func newLayoutEnv(t *testing.T, conns int32, l storeLayout) *env {
	t.Helper()
	if l.cfg.Layout == pgstore.LayoutText && l.cfg.Partitioning == nil {
		return newEnv(t, conns)
	}
	e := newEnv(t, conns) // the schema, the accounts and the text table's clean-up check
	cfg := l.cfg
	cfg.Schema, cfg.Table = e.sch.Name, "layout_inbox" // beside newEnv's text-layout table
	s, err := pgstore.New(e.sch.Pool, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	e.store = s
	e.at = time.Now().UTC().Truncate(time.Millisecond)
	e.names = map[string]string{}
	return e
}

// key returns the inbox key of the message named name: name itself in the text layout, else
// a UUIDv7 whose timestamp is e.at and whose other bits are name's first bits in order, so
// keys sort as their names do (the batch locks and claims in key order; some tests rely on
// it). Two names whose first 74 bits agree would share a key: the test fails then.
func (e *env) key(name string) string {
	if e.names == nil {
		return name
	}
	var src [10]byte
	copy(src[:], name)
	bit := func(i int) uint64 { return uint64(src[i/8]>>(7-i%8)) & 1 }
	var randA, randB uint64 // 12 and 62 bits
	for i := range 12 {
		randA = randA<<1 | bit(i)
	}
	for i := 12; i < 74; i++ {
		randB = randB<<1 | bit(i)
	}
	ms := uint64(e.at.UnixMilli())
	var b [16]byte
	for i := range 6 {
		b[i] = byte(ms >> (40 - 8*i))
	}
	b[6] = 0x70 | byte(randA>>8)
	b[7] = byte(randA)
	b[8] = 0x80 | byte(randB>>56)
	for i := 9; i < 16; i++ {
		b[i] = byte(randB >> (8 * (15 - i)))
	}
	const hexdigits = "0123456789abcdef"
	var out []byte
	for i, c := range b {
		if i == 4 || i == 6 || i == 8 || i == 10 {
			out = append(out, '-')
		}
		out = append(out, hexdigits[c>>4], hexdigits[c&15])
	}
	id := string(out)
	e.mu.Lock()
	defer e.mu.Unlock()
	if other, ok := e.names[id]; ok && other != name {
		e.t.Errorf("test names %q and %q map to the same key %s: rename one", name, other, id)
	}
	e.names[id] = name
	return id
}

// layoutKeys is the KeyExtractor of a layout env: the message UUID, mapped by env.key.
type layoutKeys struct{ e *env }

func (k layoutKeys) ExtractKey(msg *message.Message) (string, error) { return k.e.key(msg.UUID), nil }
func (k layoutKeys) Source() string                                  { return "message UUID (mapped to a UUIDv7)" }

var _ inbox.KeyExtractor = layoutKeys{}
