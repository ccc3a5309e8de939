package inbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/watermill-inbox/watermill-inbox/internal/keyrule"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// uuidV7At returns a random UUIDv7 whose embedded timestamp is t (RFC 9562: the first 48
// bits are Unix milliseconds): a producer ID minted at t.
func uuidV7At(t time.Time) string {
	u := uuid.Must(uuid.NewV7())
	ms := t.UnixMilli()
	for i := 5; i >= 0; i-- {
		u[i] = byte(ms)
		ms >>= 8
	}
	return u.String()
}

func TestRetentionValidate(t *testing.T) {
	if err := (inbox.Retention{}).Validate(); err != nil {
		t.Fatalf("the defaults are refused: %v", err)
	}
	d := inbox.Retention{}.WithDefaults()
	if d.Window != inbox.DefaultRetentionWindow || d.Window < d.MaxRedelivery+d.Margin || d.DeadLetterWindow < d.Window {
		t.Fatalf("inconsistent defaults %+v", d)
	}
	for _, c := range []struct {
		r     inbox.Retention
		field string
	}{
		{inbox.Retention{Window: 7 * 24 * time.Hour}, "Window"}, // 7 days < 7 days + 1 day
		{inbox.Retention{Window: time.Hour, MaxRedelivery: 30 * time.Minute, Margin: 31 * time.Minute}, "Window"},
		{inbox.Retention{Window: 60 * 24 * time.Hour, DeadLetterWindow: 59 * 24 * time.Hour}, "DeadLetterWindow"},
		{inbox.Retention{Margin: -time.Second}, "Margin"},
	} {
		err := c.r.Validate()
		var re *inbox.RetentionError
		if !errors.As(err, &re) || re.Field != c.field || !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("Validate(%+v) = %v, want a RetentionError on %s", c.r, err, c.field)
		}
	}
	if err := (inbox.Retention{Window: time.Hour, MaxRedelivery: 30 * time.Minute, Margin: 30 * time.Minute}).Validate(); err != nil {
		t.Fatalf("window = redelivery + margin refused: %v", err)
	}
}

func TestProducerTimeExtractors(t *testing.T) {
	at := time.Date(2026, 11, 30, 12, 34, 56, 789_000_000, time.UTC)
	got, ok := keyrule.UUIDv7Time(uuidV7At(at))
	if !ok || !got.Equal(at) {
		t.Fatalf("UUIDv7Time = %v, %v; want %v", got, ok, at)
	}
	v4 := uuid.NewString()
	for _, id := range []string{v4, "", "not-a-uuid", strings.Repeat("z", 36), strings.ToUpper(uuidV7At(at))[:35] + "g"} {
		if _, ok := keyrule.UUIDv7Time(id); ok {
			t.Errorf("UUIDv7Time(%q) found a time", id)
		}
	}
	upper := strings.ToUpper(uuidV7At(at))
	if got, ok := keyrule.UUIDv7Time(upper); !ok || !got.Equal(at) {
		t.Errorf("upper-case UUIDv7: %v, %v", got, ok)
	}
	f := inbox.ProducerTimeFromMetadata("produced_at")
	for v, want := range map[string]time.Time{
		"2026-11-30T12:34:56.789Z":      at,
		"2026-11-30T13:34:56.789+01:00": at,
		"1796042096789":                 time.UnixMilli(1796042096789),
	} {
		m := message.NewMessage("x", nil)
		m.Metadata.Set("produced_at", v)
		if got, ok, err := f(m); err != nil || !ok || !got.Equal(want) {
			t.Errorf("metadata %q: %v, %v, %v", v, got, ok, err)
		}
	}
	if _, ok, err := f(message.NewMessage("x", nil)); ok || err != nil {
		t.Errorf("no metadata: ok %v, err %v", ok, err)
	}
	m := message.NewMessage("x", nil)
	m.Metadata.Set("produced_at", "yesterday")
	if _, _, err := f(m); err == nil || strings.Contains(err.Error(), "yesterday") {
		t.Errorf("unreadable time: %v (want an error that does not echo the value)", err)
	}
}

// hourlyStore is the env's table with a 2-hour retention window.
func (e *env) hourlyStore() *pgstore.Store {
	e.t.Helper()
	s, err := pgstore.New(e.sch.Pool, pgstore.Config{Schema: e.sch.Name,
		Retention: inbox.Retention{Window: 2 * time.Hour, MaxRedelivery: time.Hour, Margin: time.Hour}})
	if err != nil {
		e.t.Fatal(err)
	}
	return s
}

// TestTooOldIsDeadLetteredAndNotRun: a message whose UUIDv7 says it was produced 3 hours ago,
// with a 2-hour window, is dead-lettered with the reason, acked, the handler never runs, no
// inbox row and no attempt is written (the dead-letter record holds 0 attempts), and a
// dead-lettered-skip is not what saves it: every copy is refused before the claim. A
// message inside the window and one without a producer time (a UUIDv4) are processed; the
// operator's replay of the dead letter runs once.
func TestTooOldIsDeadLetteredAndNotRun(t *testing.T) {
	e := newEnv(t, 3)
	dl := newDeadLetters(t)
	ib := e.inbox("billing", withDeadLetters(dl, 3), func(c *inbox.Config) {
		c.Store = e.hourlyStore()
		c.TooOld = inbox.TooOldGuard{ProducerTime: inbox.ProducerTimeFromUUIDv7()}
	})
	h := ib.Middleware(e.credit)
	old := paymentMsg(uuidV7At(time.Now().Add(-3*time.Hour)), 1, 100)
	for i := 0; i < 2; i++ {
		if err := deliver(h, old); err != nil {
			t.Fatalf("delivery %d of a too-old message: %v, want nil (dead-lettered, acked)", i+1, err)
		}
	}
	if e.runs.Load() != 0 || e.balance(1) != 0 || e.rows("message_id = $1", old.UUID) != 0 {
		t.Fatalf("too-old message: %d handler runs, balance %d, %d inbox rows; want none", e.runs.Load(), e.balance(1), e.rows("message_id = $1", old.UUID))
	}
	got := dl.wait(t, 2)
	if r := got[0].Metadata.Get(wmmiddleware.ReasonForPoisonedKey); r != inbox.ReasonTooOld {
		t.Fatalf("dead-letter reason %q, want %q", r, inbox.ReasonTooOld)
	}
	if n, _, dead := e.attemptsRow(old.UUID); !dead || n != 0 {
		t.Fatalf("attempt record: %d attempts, dead-lettered %v; want 0 attempts, dead-lettered", n, dead)
	}
	if s := ib.Stats(); s.DeadLettered != 2 || s.Processed != 0 {
		t.Fatalf("stats %+v", s)
	}

	recent := paymentMsg(uuidV7At(time.Now().Add(-time.Hour)), 2, 10)
	noTime := paymentMsg(uuid.NewString(), 2, 20)
	for _, m := range []*message.Message{recent, noTime, recent} {
		if err := deliver(h, m); err != nil {
			t.Fatal(err)
		}
	}
	if e.balance(2) != 30 || e.runs.Load() != 2 {
		t.Fatalf("inside the window: balance %d, runs %d; want 30, 2", e.balance(2), e.runs.Load())
	}

	// The operator replays the dead letter: the republished copy passes the guard, once.
	pub := &capturePublisher{}
	got[0].Metadata.Set(wmmiddleware.PoisonedTopicKey, "payments") // the router sets it; deliver does not
	if err := ib.ReplayDeadLetter(context.Background(), got[0], pub); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if err := deliver(h, pub.msgs[0]); err != nil {
			t.Fatal(err)
		}
	}
	if e.balance(1) != 100 || e.runs.Load() != 3 {
		t.Fatalf("after the replay: balance %d, runs %d; want 100, 3", e.balance(1), e.runs.Load())
	}
}

type capturePublisher struct{ msgs []*message.Message }

func (p *capturePublisher) Publish(topic string, msgs ...*message.Message) error {
	p.msgs = append(p.msgs, msgs...)
	return nil
}
func (p *capturePublisher) Close() error { return nil }

// TestTooOldProcessedWithOption: with ProcessTooOld the message is processed once and a
// warning is logged; a future-dated one is refused all the same.
func TestTooOldProcessedWithOption(t *testing.T) {
	e := newEnv(t, 3)
	dl := newDeadLetters(t)
	logs := watermill.NewCaptureLogger()
	cfg := inbox.Config{Store: e.hourlyStore(), ConsumerName: "billing", DeadLetterPublisher: dl, DeadLetterTopic: dlTopic,
		TooOld: inbox.TooOldGuard{ProducerTime: inbox.ProducerTimeFromMetadata("produced_at"), ProcessTooOld: true}}
	ib, err := inbox.New(cfg, logs)
	if err != nil {
		t.Fatal(err)
	}
	h := ib.Middleware(e.credit)
	old := paymentMsg(uuid.NewString(), 1, 100)
	old.Metadata.Set("produced_at", time.Now().Add(-5*time.Hour).UTC().Format(time.RFC3339))
	for i := 0; i < 2; i++ {
		if err := deliver(h, old); err != nil {
			t.Fatal(err)
		}
	}
	if e.balance(1) != 100 || e.runs.Load() != 1 {
		t.Fatalf("too old, processed: balance %d, runs %d; want 100, 1", e.balance(1), e.runs.Load())
	}
	warned := 0
	for _, m := range logs.Captured()[watermill.InfoLogLevel] {
		if strings.Contains(m.Msg, "older than the retention window") {
			warned++
		}
	}
	if warned != 2 {
		t.Fatalf("%d warnings logged, want one per delivery (2)", warned)
	}

	future := paymentMsg(uuid.NewString(), 3, 7)
	future.Metadata.Set("produced_at", time.Now().Add(time.Hour).UTC().Format(time.RFC3339Nano))
	if err := deliver(h, future); err != nil {
		t.Fatal(err)
	}
	if e.balance(3) != 0 || e.runs.Load() != 1 {
		t.Fatalf("future-dated: balance %d, runs %d; want 0, 1", e.balance(3), e.runs.Load())
	}
	if r := dl.wait(t, 1)[0].Metadata.Get(wmmiddleware.ReasonForPoisonedKey); r != inbox.ReasonFutureProducerTime {
		t.Fatalf("reason %q", r)
	}
	// Within the allowed skew (default 5 minutes): processed.
	skewed := paymentMsg(uuid.NewString(), 3, 8)
	skewed.Metadata.Set("produced_at", time.Now().Add(time.Minute).UTC().Format(time.RFC3339Nano))
	if err := deliver(h, skewed); err != nil || e.balance(3) != 8 {
		t.Fatalf("within the skew: %v, balance %d", err, e.balance(3))
	}
}

// TestFutureDatedRefusedWithoutDeadLetterTopic: without a dead-letter topic a future-dated
// message is a permanent failure (nacked, never processed); a guard without a window is a
// configuration error.
func TestFutureDatedRefusedWithoutDeadLetterTopic(t *testing.T) {
	e := newEnv(t, 2)
	ib := e.inbox("billing", func(c *inbox.Config) {
		c.TooOld = inbox.TooOldGuard{ProducerTime: inbox.ProducerTimeFromUUIDv7(), Window: time.Hour, MaxClockSkew: time.Second}
	})
	err := deliver(ib.Middleware(e.credit), paymentMsg(uuidV7At(time.Now().Add(time.Minute)), 1, 5))
	if !errors.Is(err, inbox.ErrFutureProducerTime) || !inbox.IsPermanent(err) {
		t.Fatalf("future-dated: %v, want a permanent ErrFutureProducerTime", err)
	}
	if e.runs.Load() != 0 || e.balance(1) != 0 || e.rows("") != 0 {
		t.Fatal("a future-dated message was processed")
	}
	_, err = inbox.New(inbox.Config{Store: e.store, ConsumerName: "x", TooOld: inbox.TooOldGuard{ProducerTime: inbox.ProducerTimeFromUUIDv7()}}, nil)
	if !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "retention window") {
		t.Fatalf("a guard without a window: %v", err)
	}
}

// uuidV7Cases are the inputs of the UUIDv7 reader's table tests: canonical-form UUIDv7s
// (want: the time; RFC 9562 appendix A.6's example and the 48-bit extremes) and strings that
// are not (want: zero, refused).
var uuidV7Cases = []struct {
	name, id string
	want     int64 // Unix milliseconds; -1: refused
}{
	{"rfc 9562 example", "017f22e2-79b0-7cc3-98c4-dc0c0c07398f", 1645557742000},
	{"variant 8", "017f22e2-79b0-7cc3-88c4-dc0c0c07398f", 1645557742000},
	{"variant a", "017f22e2-79b0-7cc3-a8c4-dc0c0c07398f", 1645557742000},
	{"variant b", "017f22e2-79b0-7cc3-b8c4-dc0c0c07398f", 1645557742000},
	{"epoch", "00000000-0000-7000-8000-000000000000", 0},
	{"largest 48-bit time", "ffffffff-ffff-7fff-bfff-ffffffffffff", 1<<48 - 1},
	{"upper case", "017F22E2-79B0-7CC3-98C4-DC0C0C07398F", 1645557742000},
	{"mixed case", "017f22E2-79b0-7Cc3-98c4-dc0c0c07398F", 1645557742000},
	{"version 4", "017f22e2-79b0-4cc3-98c4-dc0c0c07398f", -1},
	{"version 6", "017f22e2-79b0-6cc3-98c4-dc0c0c07398f", -1},
	{"version 8", "017f22e2-79b0-8cc3-98c4-dc0c0c07398f", -1},
	{"nil uuid", "00000000-0000-0000-0000-000000000000", -1},
	{"variant 0 (NCS)", "017f22e2-79b0-7cc3-08c4-dc0c0c07398f", -1},
	{"variant 7 (NCS)", "017f22e2-79b0-7cc3-78c4-dc0c0c07398f", -1},
	{"variant c (Microsoft)", "017f22e2-79b0-7cc3-c8c4-dc0c0c07398f", -1},
	{"variant f (future)", "017f22e2-79b0-7cc3-f8c4-dc0c0c07398f", -1},
	{"empty", "", -1},
	{"35 characters", "017f22e2-79b0-7cc3-98c4-dc0c0c07398", -1},
	{"37 characters", "017f22e2-79b0-7cc3-98c4-dc0c0c07398f0", -1},
	{"braces", "{017f22e2-79b0-7cc3-98c4-dc0c0c07398f}", -1},
	{"urn", "urn:uuid:017f22e2-79b0-7cc3-98c4-dc0c0c07398f", -1},
	{"no hyphens", "017f22e279b07cc398c4dc0c0c07398f", -1},
	{"hyphen misplaced", "017f22e27-9b0-7cc3-98c4-dc0c0c07398f", -1},
	{"non-hex digit", "017f22e2-79b0-7cc3-98c4-dc0c0c07398g", -1},
	{"space", "017f22e2-79b0-7cc3-98c4-dc0c0c07398 ", -1},
	{"not a uuid", strings.Repeat("z", 36), -1},
}

// TestUUIDv7Time: the module's one UUIDv7 reader (pgstore's ProducerTimeFromKey calls it)
// returns the embedded Unix milliseconds of every canonical-form UUIDv7, either case, and
// refuses other versions, other variants and malformed strings.
func TestUUIDv7Time(t *testing.T) {
	for _, c := range uuidV7Cases {
		got, ok := keyrule.UUIDv7Time(c.id)
		switch {
		case c.want < 0 && (ok || !got.IsZero()):
			t.Errorf("%s: UUIDv7Time(%q) = %v, %v; want refused", c.name, c.id, got, ok)
		case c.want >= 0 && (!ok || got.UnixMilli() != c.want):
			t.Errorf("%s: UUIDv7Time(%q) = %v (%d ms), %v; want %d ms", c.name, c.id, got, got.UnixMilli(), ok, c.want)
		}
	}
	if got, _ := keyrule.UUIDv7Time(uuidV7Cases[0].id); !got.Equal(time.Date(2022, 2, 22, 19, 22, 22, 0, time.UTC)) {
		t.Errorf("RFC 9562's example reads as %v, want 2022-02-22T19:22:22Z (its appendix A.6)", got.UTC())
	}
}
