package inboxmetrics

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
)

// DeferredCollector exports the store-then-process inbox's queue (package middleware/deferred)
// on every scrape: one row-count statement per consumer (deferred.Inbox.Stats, which reads
// only the partial indexes of unfinished, processing and dead rows), plus this process's
// counters. Register it with your Registerer: reg.MustRegister(c).
//
// Metrics, all labelled by consumer:
//
//	watermill_inbox_deferred_pending_rows              gauge    rows waiting (backoff and order included)
//	watermill_inbox_deferred_oldest_pending_age_seconds gauge   now - the oldest pending row's received_at (database clock); 0 when none
//	watermill_inbox_deferred_processing_rows           gauge    rows claimed by workers
//	watermill_inbox_deferred_dead_rows                 gauge    rows in status dead
//	watermill_inbox_deferred_stuck_aggregates          gauge    aggregates whose head has waited longer than deferred.Config.StuckAfter (deferred.Stats.StuckAggregates)
//	watermill_inbox_deferred_rows_total{event}         counter  this process: received, duplicate, collision, refused, done, failed, dead, fenced, reaped
//	watermill_inbox_deferred_stats_up                  gauge    1 when the last read succeeded, 0 when it failed (the row gauges are then absent)
type DeferredCollector struct {
	inboxes []*deferred.Inbox
	timeout time.Duration

	pending, oldest, processing, dead, stuck, rows, up *prometheus.Desc
}

// NewDeferredCollector returns a collector for the given store-then-process inboxes (one per
// consumer name). timeout bounds each scrape's read (seconds; 0 means 5 s).
func NewDeferredCollector(timeout time.Duration, inboxes ...*deferred.Inbox) *DeferredCollector {
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(Namespace, "deferred", name), help, append([]string{"consumer"}, labels...), nil)
	}
	return &DeferredCollector{
		inboxes:    inboxes,
		timeout:    timeout,
		pending:    d("pending_rows", "Store-then-process rows waiting to be handled (backoff and per-aggregate order included)."),
		oldest:     d("oldest_pending_age_seconds", "Age of the oldest pending store-then-process row, in seconds (database clock); 0 when none is pending."),
		processing: d("processing_rows", "Store-then-process rows claimed by workers."),
		dead:       d("dead_rows", "Store-then-process rows in status dead (attempts used up or a permanent error)."),
		stuck:      d("stuck_aggregates", "Store-then-process aggregates whose head row has waited longer than the inbox's StuckAfter (a gap in producer sequences, a failing or dead head holding its aggregate, or workers behind)."),
		rows:       d("rows_total", "Store-then-process events in this process, by event.", "event"),
		up:         d("stats_up", "1 when the last read of the store-then-process table succeeded, else 0."),
	}
}

// Describe implements prometheus.Collector.
func (c *DeferredCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.pending, c.oldest, c.processing, c.dead, c.stuck, c.rows, c.up} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: it reads each inbox's Stats (a failed read sets
// stats_up to 0 for that consumer and leaves its row gauges out; the scrape goes on).
func (c *DeferredCollector) Collect(ch chan<- prometheus.Metric) {
	for _, ib := range c.inboxes {
		name := ib.ConsumerName()
		ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
		st, err := ib.Stats(ctx)
		cancel()
		counters := []struct {
			event string
			n     uint64
		}{
			{"received", st.Counters.Received}, {"duplicate", st.Counters.Duplicates},
			{"collision", st.Counters.Collisions}, {"refused", st.Counters.Refused}, {"too_old", st.Counters.TooOld},
			{"done", st.Counters.Done}, {"failed", st.Counters.Failed}, {"dead", st.Counters.Dead},
			{"fenced", st.Counters.Fenced}, {"reaped", st.Counters.Reaped},
		}
		if err != nil {
			ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0, name)
			continue
		}
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 1, name)
		ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(st.Pending), name)
		ch <- prometheus.MustNewConstMetric(c.oldest, prometheus.GaugeValue, st.OldestPendingAge.Seconds(), name)
		ch <- prometheus.MustNewConstMetric(c.processing, prometheus.GaugeValue, float64(st.Processing), name)
		ch <- prometheus.MustNewConstMetric(c.dead, prometheus.GaugeValue, float64(st.Dead), name)
		ch <- prometheus.MustNewConstMetric(c.stuck, prometheus.GaugeValue, float64(st.StuckAggregates), name)
		for _, k := range counters {
			ch <- prometheus.MustNewConstMetric(c.rows, prometheus.CounterValue, float64(k.n), name, k.event)
		}
	}
}
