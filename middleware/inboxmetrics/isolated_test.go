package inboxmetrics_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxmetrics"
)

// TestIsolatedDeliveriesCounted: a Result with Isolated set (a crash suspect that ran alone,
// middleware/inbox's TestCrashSuspectRunsAlone checks Result.Isolated) counts once in
// watermill_inbox_isolated_deliveries_total; one without does not.
func TestIsolatedDeliveriesCounted(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := inboxmetrics.New(reg, inboxmetrics.Options{})
	if err != nil {
		t.Fatal(err)
	}
	obs := m.Observer("billing")
	key := inbox.Key{MessageID: "m-1", ConsumerName: "billing"}
	obs.ObserveDelivery(context.Background(), inbox.Result{Outcome: inbox.OutcomeProcessed, Key: key, Isolated: true})
	obs.ObserveDelivery(context.Background(), inbox.Result{Outcome: inbox.OutcomeProcessed, Key: key})
	if got := value(t, reg, "watermill_inbox_isolated_deliveries_total", map[string]string{"consumer": "billing"}); got != 1 {
		t.Fatalf("isolated deliveries %v, want 1", got)
	}
}

// TestDuplicateAgeObserved: a duplicate's DuplicateAge lands in duplicate_age_seconds, once;
// a processed delivery adds nothing.
func TestDuplicateAgeObserved(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := inboxmetrics.New(reg, inboxmetrics.Options{})
	if err != nil {
		t.Fatal(err)
	}
	obs := m.Observer("billing")
	key := inbox.Key{MessageID: "m-1", ConsumerName: "billing"}
	obs.ObserveDelivery(context.Background(), inbox.Result{Outcome: inbox.OutcomeProcessed, Key: key})
	obs.ObserveDelivery(context.Background(), inbox.Result{Outcome: inbox.OutcomeDuplicate, Key: key, DuplicateAge: 2 * time.Hour})
	if got := value(t, reg, "watermill_inbox_duplicate_age_seconds", map[string]string{"consumer": "billing"}); got != 1 {
		t.Fatalf("duplicate ages observed %v, want 1", got)
	}
}
