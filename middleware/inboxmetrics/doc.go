// Package inboxmetrics exports the inbox's counters, phase histograms, outbox relay figures and
// table gauges to Prometheus (github.com/prometheus/client_golang). It lives apart from the
// core package inbox, so a program that does not use Prometheus does not link it.
//
//	m, err := inboxmetrics.New(prometheus.DefaultRegisterer, inboxmetrics.Options{})
//	obs, err := m.NewObserver("billing")
//	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing", Observer: obs}, logger)
//	tables, err := inboxmetrics.NewTableCollector(store, inboxmetrics.TableConfig{})
//	prometheus.MustRegister(tables)
//	http.Handle("/metrics", promhttp.Handler())
//
// Every metric is named watermill_inbox_* and labelled only by bounded values: the consumer
// name and the topic (at most Options.MaxConsumers and Options.MaxTopics values each, the
// rest counted under Other), the outcome, the table or the outbox topic; never a message ID
// or key. Registration is explicit: nothing is registered on a global registry unless you pass
// it. docs/observability.md lists every metric with its type, unit, labels and meaning.
package inboxmetrics
