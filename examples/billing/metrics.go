//go:build unix

package main

import (
	"errors"
	"fmt"
	"math"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"

	"github.com/watermill-inbox/watermill-inbox/middleware/inboxmetrics"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// demoMetrics is the consumer's Prometheus registry: the inbox metrics (set as the billing
// inbox's Observer) and the table gauges, served on -metrics-addr while the consumer runs and
// summed up in the consumer's STATS line.
type demoMetrics struct {
	reg *prometheus.Registry
	m   *inboxmetrics.Metrics
}

// newDemoMetrics registers the inbox metrics and, with a pgstore store, its table gauges, and serves /metrics on
// addr when it is not empty (the server dies with the process).
func newDemoMetrics(addr string, store *pgstore.Store) (*demoMetrics, error) {
	reg := prometheus.NewRegistry()
	m, err := inboxmetrics.New(reg, inboxmetrics.Options{})
	if err != nil {
		return nil, err
	}
	if store != nil { // the table gauges read pgstore's tables; sqlstore (-db=pgsql|mysql) has none
		tables, err := inboxmetrics.NewTableCollector(store, inboxmetrics.TableConfig{Outbox: &inboxmetrics.OutboxTables{Schema: store.Config().Schema}})
		if err != nil {
			return nil, err
		}
		if err := reg.Register(tables); err != nil {
			return nil, err
		}
	}
	if addr != "" {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				fmt.Fprintln(os.Stderr, "metrics server:", err)
			}
		}()
	}
	return &demoMetrics{reg: reg, m: m}, nil
}

// summary returns the billing inbox's dedup hit rate (duplicates / deliveries) and the claim
// latency's 99th percentile in seconds, estimated from the histogram's buckets as PromQL's
// histogram_quantile does (linear within the bucket). NaN when nothing was observed.
func (d *demoMetrics) summary() (hitRate, claimP99 float64) {
	hitRate, claimP99 = math.NaN(), math.NaN()
	if d == nil {
		return
	}
	mfs, err := d.reg.Gather()
	if err != nil {
		return
	}
	var dup, all float64
	for _, mf := range mfs {
		switch mf.GetName() {
		case "watermill_inbox_deliveries_total":
			for _, m := range mf.GetMetric() {
				all += m.GetCounter().GetValue()
				for _, l := range m.GetLabel() {
					if l.GetName() == "outcome" && l.GetValue() == "duplicate" {
						dup += m.GetCounter().GetValue()
					}
				}
			}
		case "watermill_inbox_claim_duration_seconds":
			for _, m := range mf.GetMetric() {
				claimP99 = quantile(0.99, m.GetHistogram())
			}
		}
	}
	if all > 0 {
		hitRate = dup / all
	}
	return hitRate, claimP99
}

// quantile estimates the q-quantile of h like PromQL's histogram_quantile.
func quantile(q float64, h *dto.Histogram) float64 {
	total := float64(h.GetSampleCount())
	if total == 0 {
		return math.NaN()
	}
	rank, lower, below := q*total, 0.0, 0.0
	for _, b := range h.GetBucket() {
		count := float64(b.GetCumulativeCount())
		if count >= rank {
			if count == below {
				return b.GetUpperBound()
			}
			return lower + (b.GetUpperBound()-lower)*(rank-below)/(count-below)
		}
		lower, below = b.GetUpperBound(), count
	}
	return lower // in the +Inf bucket: the highest finite bound
}
