package pgstore_test

import (
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-inbox/watermill-inbox/internal/keyrule"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// TestUUIDv7TimeOfKey: ProducerTimeFromKey reads keys with inbox.UUIDv7Time, restricted to
// canonical lowercase (the form LayoutMigrationSQL's pattern converts): a lowercase UUIDv7
// gives the same instant (in UTC) and its period; upper or mixed case, other versions, other
// variants and malformed keys are refused, and Check reports ErrKeyNotUUIDv7 wrapping
// inbox.ErrInvalidKey for them.
func TestUUIDv7TimeOfKey(t *testing.T) {
	s, err := pgstore.New(&pgxpool.Pool{}, pgstore.Config{Partitioning: &pgstore.Partitioning{
		Interval: pgstore.PartitionDaily, ProducerTime: pgstore.ProducerTimeFromKey}})
	if err != nil {
		t.Fatal(err)
	}
	example := time.Date(2022, 2, 22, 19, 22, 22, 0, time.UTC) // RFC 9562, appendix A.6
	for _, c := range []struct {
		name, id string
		want     time.Time // zero: refused
	}{
		{"rfc 9562 example", "017f22e2-79b0-7cc3-98c4-dc0c0c07398f", example},
		{"variant b", "017f22e2-79b0-7cc3-b8c4-dc0c0c07398f", example},
		{"epoch", "00000000-0000-7000-8000-000000000000", time.UnixMilli(0).UTC()},
		{"upper case", "017F22E2-79B0-7CC3-98C4-DC0C0C07398F", time.Time{}},
		{"mixed case", "017f22e2-79b0-7cc3-98c4-dc0c0c07398F", time.Time{}},
		{"version 4", "017f22e2-79b0-4cc3-98c4-dc0c0c07398f", time.Time{}},
		{"variant c", "017f22e2-79b0-7cc3-c8c4-dc0c0c07398f", time.Time{}},
		{"no hyphens", "017f22e279b07cc398c4dc0c0c07398f", time.Time{}},
		{"braces", "{017f22e2-79b0-7cc3-98c4-dc0c0c07398f}", time.Time{}},
		{"non-hex digit", "017f22e2-79b0-7cc3-98c4-dc0c0c07398g", time.Time{}},
		{"message name", "payment-1", time.Time{}},
	} {
		got, ok := pgstore.UUIDv7Time(c.id)
		inboxTime, inboxOK := keyrule.UUIDv7Time(c.id)
		err := s.Check(plain(c.id, "c"))
		if c.want.IsZero() {
			if ok || !got.IsZero() || !errors.Is(err, pgstore.ErrKeyNotUUIDv7) || !errors.Is(err, inbox.ErrInvalidKey) {
				t.Errorf("%s: %q read as %v, %v (Check: %v); want refused", c.name, c.id, got, ok, err)
			}
			continue
		}
		if !ok || !got.Equal(c.want) || got.Location() != time.UTC || err != nil {
			t.Errorf("%s: %q read as %v, %v (Check: %v); want %v UTC", c.name, c.id, got, ok, err, c.want)
		}
		if !inboxOK || !inboxTime.Equal(got) {
			t.Errorf("%s: inbox.UUIDv7Time gives %v, %v; pgstore %v", c.name, inboxTime, inboxOK, got)
		}
		if p := pgstore.PeriodOf(got, pgstore.PartitionDaily); !p.Equal(c.want.Truncate(24 * time.Hour)) {
			t.Errorf("%s: period %v", c.name, p)
		}
	}
}
