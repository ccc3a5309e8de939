package inboxmetrics_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxmetrics"
)

// labelValues returns the distinct values of label among the series of name.
func labelValues(t *testing.T, reg *prometheus.Registry, name, label string) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == label {
					out[lp.GetValue()] += m.GetCounter().GetValue()
				}
			}
		}
	}
	return out
}

// TestConsumerNamesAreBounded: 2,000 consumer names, one delivery each, give at most
// MaxConsumers consumer label values plus Other, the sum over consumers is every delivery,
// Other holds the rest, label_bound_reached says so; the default bound holds the same way,
// and the number of series stops growing at the bound.
func TestConsumerNamesAreBounded(t *testing.T) {
	for _, tc := range []struct {
		max, want int
	}{{10, 10}, {0, inboxmetrics.DefaultMaxConsumers}} {
		t.Run(fmt.Sprint(tc.want), func(t *testing.T) {
			reg := prometheus.NewRegistry()
			m, err := inboxmetrics.New(reg, inboxmetrics.Options{MaxConsumers: tc.max})
			if err != nil {
				t.Fatal(err)
			}
			const names = 2000
			var atBound int
			for i := range names {
				obs, err := m.NewObserver(fmt.Sprintf("tenant-%d", i))
				if err != nil {
					t.Fatal(err)
				}
				obs.ObserveDelivery(context.Background(), inbox.Result{Outcome: inbox.OutcomeProcessed, Key: inbox.Key{MessageID: "m"}})
				if i == tc.want {
					atBound = series(t, reg)
				}
			}
			got := labelValues(t, reg, "watermill_inbox_deliveries_total", "consumer")
			if len(got) != tc.want+1 {
				t.Fatalf("%d consumer label values, want %d and %s", len(got), tc.want, inboxmetrics.Other)
			}
			var sum float64
			for _, v := range got {
				sum += v
			}
			if sum != names || got[inboxmetrics.Other] != names-float64(tc.want) || got["tenant-0"] != 1 {
				t.Fatalf("sum %v, %s %v, tenant-0 %v; want %d, %d, 1", sum, inboxmetrics.Other, got[inboxmetrics.Other], got["tenant-0"], names, names-tc.want)
			}
			if v := value(t, reg, "watermill_inbox_label_bound_reached", map[string]string{"label": "consumer"}); v != 1 {
				t.Fatalf("label_bound_reached{consumer} = %v", v)
			}
			if after := series(t, reg); after != atBound {
				t.Fatalf("series grew from %d to %d past the bound", atBound, after)
			}
		})
	}
}

// TestRelayTopicsAreBounded: the relay's destination topics are bounded by MaxTopics the same
// way, and a topic that is not valid UTF-8 (which Prometheus would refuse, panicking in
// WithLabelValues) is counted under Other.
func TestRelayTopicsAreBounded(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := inboxmetrics.New(reg, inboxmetrics.Options{MaxTopics: 5})
	if err != nil {
		t.Fatal(err)
	}
	pub := m.RelayPublisher(nopPublisher{})
	for i := range 500 {
		if err := pub.Publish(fmt.Sprintf("topic-%d", i), message.NewMessage("m", nil)); err != nil {
			t.Fatal(err)
		}
	}
	if err := pub.Publish("bad-\xff", message.NewMessage("m", nil)); err != nil {
		t.Fatal(err)
	}
	got := labelValues(t, reg, "watermill_inbox_outbox_relayed_messages_total", "topic")
	if len(got) != 6 || got[inboxmetrics.Other] != 496 {
		t.Fatalf("relay topics %v, want 5 and %s with 496", got, inboxmetrics.Other)
	}
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// TestObserverRefusesWhatInboxNewRefuses: every kind of consumer name inbox.New refuses (empty,
// blank, a newline, an escape sequence, NUL, invalid UTF-8, one byte over
// inbox.MaxConsumerNameBytes) is refused by NewObserver too (with ErrInvalidConfig), as is
// Other, and Observer's observer for it creates no series; the longest name inbox.New accepts
// is accepted. (The names are listed here, not checked against inbox.New, so the test does not
// depend on the core's store contract.)
func TestObserverRefusesWhatInboxNewRefuses(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := inboxmetrics.New(reg, inboxmetrics.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"", "   ", "a\nb", "esc\x1b[2K", "nul\x00", "bad-\xff", strings.Repeat("n", inbox.MaxConsumerNameBytes+1)} {
		obs, err := m.NewObserver(name)
		if !errors.Is(err, inbox.ErrInvalidConfig) || obs != nil {
			t.Errorf("NewObserver(%q) = %v, %v; want ErrInvalidConfig", name, obs, err)
		}
		// Observer, without the error, records nothing for it (no series; no panic on
		// invalid UTF-8, which Prometheus refuses as a label value).
		m.Observer(name).ObserveDelivery(context.Background(), inbox.Result{Outcome: inbox.OutcomeProcessed, Key: inbox.Key{MessageID: "m"}})
	}
	if _, err := m.NewObserver(inboxmetrics.Other); !errors.Is(err, inboxmetrics.ErrReservedConsumer) {
		t.Errorf("Observer(%q): %v, want ErrReservedConsumer", inboxmetrics.Other, err)
	}
	if got := labelValues(t, reg, "watermill_inbox_deliveries_total", "consumer"); len(got) != 0 {
		t.Fatalf("series for refused names: %v", got)
	}
	name := strings.Repeat("n", inbox.MaxConsumerNameBytes)
	if _, err := m.NewObserver(name); err != nil {
		t.Fatalf("Observer of a name inbox.New accepts: %v", err)
	}
}
