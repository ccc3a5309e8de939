package inboxmetrics

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Namespace is the prefix of every metric this package exports.
const Namespace = "watermill_inbox"

// DefaultBuckets are the bucket upper bounds, in seconds, of the claim, handler, commit and
// relay-lag histograms: from half a millisecond (a claim on a warm connection) to a minute (a
// claim waiting behind a slow concurrent copy, bounded by inbox.DefaultClaimTimeout, 30 s).
var DefaultBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

// DuplicateAgeBuckets are the bucket upper bounds, in seconds, of duplicate_age_seconds:
// from a second (a redelivery after a nack) to 60 days (an offset reset or a replay long after
// the event), by the steps a retention window is chosen in.
var DuplicateAgeBuckets = []float64{1, 10, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 86400, 2 * 86400, 3 * 86400,
	7 * 86400, 14 * 86400, 30 * 86400, 60 * 86400}

// Options configures Metrics. The zero value is ready to use.
type Options struct {
	// Buckets overrides DefaultBuckets (seconds, increasing).
	Buckets []float64
	// ConstLabels are added to every metric (e.g. {"service": "billing"}). They must be
	// bounded, like every label.
	ConstLabels prometheus.Labels
	// MaxConsumers bounds the consumer names with series of their own: the first
	// MaxConsumers names given to Observer keep their name as the consumer label, every
	// later one is counted under Other (folded, not refused: metrics never stop a consumer,
	// and sums over consumers stay exact). Default: DefaultMaxConsumers.
	MaxConsumers int
	// MaxTopics bounds the topic label the same way (the subscribed topics of the
	// deliveries and the relay's destination topics, each counted apart). Default:
	// DefaultMaxTopics.
	MaxTopics int
}

// Metrics holds the inbox's and the outbox relay's counters and histograms. Create it once
// per registry with New, then take an Observer per inbox (Observer) and wrap the relay's
// publisher (RelayPublisher). It is safe for concurrent use.
type Metrics struct {
	deliveries  *prometheus.CounterVec
	invalidKeys *prometheus.CounterVec
	collisions  *prometheus.CounterVec
	txRetries   *prometheus.CounterVec
	keyBrakes   *prometheus.CounterVec
	isolated    *prometheus.CounterVec
	claim       *prometheus.HistogramVec
	handler     *prometheus.HistogramVec
	commit      *prometheus.HistogramVec
	dupAge      *prometheus.HistogramVec
	relayed     *prometheus.CounterVec
	relayLag    *prometheus.HistogramVec
	relayErrors *prometheus.CounterVec

	consumers, topics, relayTopics *bounded
	bound                          *prometheus.GaugeVec
}

// New creates the metrics and registers them with reg (required: pass
// prometheus.DefaultRegisterer explicitly to use the global registry). It returns the
// registry's error (prometheus.AlreadyRegisteredError when New already ran on reg) or an error
// for a nil reg.
func New(reg prometheus.Registerer, opts Options) (*Metrics, error) {
	if reg == nil {
		return nil, errors.New("inboxmetrics: nil Registerer")
	}
	if opts.MaxConsumers <= 0 {
		opts.MaxConsumers = DefaultMaxConsumers
	}
	if opts.MaxTopics <= 0 {
		opts.MaxTopics = DefaultMaxTopics
	}
	buckets := opts.Buckets
	if len(buckets) == 0 {
		buckets = DefaultBuckets
	}
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: Namespace, Name: name, Help: help, ConstLabels: opts.ConstLabels}, labels)
	}
	histogram := func(name, help string, labels ...string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: Namespace, Name: name, Help: help, Buckets: buckets, ConstLabels: opts.ConstLabels}, labels)
	}
	m := &Metrics{
		deliveries: counter("deliveries_total",
			"Deliveries that reached the inbox, by outcome (processed, duplicate, collision, dead_lettered, dead_lettered_skip, failed_retryable, failed_final).",
			"consumer", "topic", "outcome"),
		invalidKeys: counter("invalid_keys_total",
			"Deliveries whose key was missing or invalid (also counted in deliveries_total under their outcome).", "consumer", "topic"),
		collisions: counter("key_collisions_total",
			"Deliveries whose key was already processed with a different payload (also counted in deliveries_total).", "consumer", "topic"),
		txRetries: counter("tx_retries_total",
			"In-process retries of the inbox transaction after SQLSTATE 40001 or 40P01.", "consumer", "topic"),
		keyBrakes: counter("invalid_key_brakes_total",
			"Deliveries nacked by the invalid-key brake during an invalid-key flood (also in invalid_keys_total).", "consumer", "topic"),
		isolated: counter("isolated_deliveries_total",
			"Deliveries that ran their handler alone among their inbox's deliveries in the process, because their key had attempts that ended unsettled (crash isolation).", "consumer", "topic"),
		claim: histogram("claim_duration_seconds",
			"Time to claim the message: connection, attempt count, BEGIN and the claim insert, including the wait behind a concurrent copy.", "consumer", "topic"),
		handler: histogram("handler_duration_seconds",
			"Time in the handler and in storing its produced messages in the outbox.", "consumer", "topic"),
		commit: histogram("commit_duration_seconds",
			"Time of the inbox transaction's COMMIT.", "consumer", "topic"),
		dupAge: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: Namespace, Name: "duplicate_age_seconds",
			Help:    "Age of each duplicate (and key collision) when it arrived: now minus when its key's claim was stored. Set the retention window above its maximum, with a margin.",
			Buckets: DuplicateAgeBuckets, ConstLabels: opts.ConstLabels}, []string{"consumer", "topic"}),
		relayed: counter("outbox_relayed_messages_total",
			"Messages the outbox relay published to the broker, by destination topic (at least once: a republish after a crash counts again).", "topic"),
		relayLag: histogram("outbox_relay_lag_seconds",
			"Time from storing a message in the outbox to the relay's publish returning (wall clocks of the writer and the relay).", "topic"),
		relayErrors: counter("outbox_relay_publish_errors_total",
			"Failed publishes of the outbox relay (the message is published again later).", "topic"),
		bound: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: Namespace, Name: "label_bound_reached",
			Help:        "1 once a label value was counted under \"" + Other + "\" because its bound (Options.MaxConsumers, Options.MaxTopics) was reached, by label: consumer, topic, relay_topic.",
			ConstLabels: opts.ConstLabels}, []string{"label"}),
	}
	m.consumers = newBounded(opts.MaxConsumers, m.bound.WithLabelValues("consumer"))
	m.topics = newBounded(opts.MaxTopics, m.bound.WithLabelValues("topic"))
	m.relayTopics = newBounded(opts.MaxTopics, m.bound.WithLabelValues("relay_topic"))
	for _, c := range []prometheus.Collector{m.deliveries, m.invalidKeys, m.collisions, m.txRetries, m.keyBrakes, m.isolated,
		m.claim, m.handler, m.commit, m.dupAge, m.relayed, m.relayLag, m.relayErrors, m.bound} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("inboxmetrics: register: %w", err)
		}
	}
	return m, nil
}

// NewObserver returns the inbox.Observer for the inbox of consumer (its Config.ConsumerName;
// set it as that inbox's Config.Observer). Per delivery it counts the outcome, an invalid
// key, a key collision, an invalid-key brake, the transaction retries and a crash-isolated
// run, and observes the claim, handler and commit durations of the delivery's last
// transaction (phases that did not run are not observed). The topic label is the subscribed
// topic from the message context (message.SubscribeTopicFromCtx; "" outside a Watermill
// router).
//
// Both labels are bounded (Options.MaxConsumers, Options.MaxTopics): past the bound, a new
// consumer name or topic is counted under Other. NewObserver returns an error wrapping
// inbox.ErrInvalidConfig for a name inbox.New refuses (empty or blank, over
// inbox.MaxConsumerNameBytes, invalid UTF-8, NUL, a control character), and
// ErrReservedConsumer for Other.
func (m *Metrics) NewObserver(consumer string) (inbox.Observer, error) {
	if err := validateConsumer(consumer); err != nil {
		return nil, err
	}
	return observer{m: m, consumer: m.consumers.label(consumer)}, nil
}

// Observer is NewObserver without the error: for a name NewObserver refuses it returns an
// observer that records nothing (inbox.New refuses the same name; Other is never given to a
// real consumer). Prefer NewObserver.
func (m *Metrics) Observer(consumer string) inbox.Observer {
	o, err := m.NewObserver(consumer)
	if err != nil {
		return nopObserver{}
	}
	return o
}

type nopObserver struct{}

func (nopObserver) ObserveDelivery(context.Context, inbox.Result) {}

type observer struct {
	m        *Metrics
	consumer string
}

func (o observer) ObserveDelivery(ctx context.Context, r inbox.Result) {
	m := o.m
	topic := m.topic(m.topics, message.SubscribeTopicFromCtx(ctx))
	m.deliveries.WithLabelValues(o.consumer, topic, r.Outcome.String()).Inc()
	if r.Key.MessageID == "" {
		m.invalidKeys.WithLabelValues(o.consumer, topic).Inc()
		if errors.Is(r.Err, inbox.ErrInvalidKeyFlood) {
			m.keyBrakes.WithLabelValues(o.consumer, topic).Inc()
		}
	}
	if r.Collision {
		m.collisions.WithLabelValues(o.consumer, topic).Inc()
	}
	if r.TxRetries > 0 {
		m.txRetries.WithLabelValues(o.consumer, topic).Add(float64(r.TxRetries))
	}
	if r.Isolated {
		m.isolated.WithLabelValues(o.consumer, topic).Inc()
	}
	if r.Claim > 0 {
		m.claim.WithLabelValues(o.consumer, topic).Observe(r.Claim.Seconds())
	}
	if r.Handler > 0 {
		m.handler.WithLabelValues(o.consumer, topic).Observe(r.Handler.Seconds())
	}
	if r.Commit > 0 {
		m.commit.WithLabelValues(o.consumer, topic).Observe(r.Commit.Seconds())
	}
	if r.DuplicateAge > 0 {
		m.dupAge.WithLabelValues(o.consumer, topic).Observe(r.DuplicateAge.Seconds())
	}
}

// topic returns the bounded label of a topic; a topic that is not valid UTF-8 (which
// Prometheus refuses as a label value) is Other.
func (m *Metrics) topic(b *bounded, topic string) string {
	if !utf8.ValidString(topic) {
		return Other
	}
	return b.label(topic)
}

// StoredAtKey is the metadata field in which the Outbox wrapper records when a message was
// stored in the outbox (Unix time in nanoseconds, decimal), for the relay lag. RelayPublisher
// removes it before publishing.
const StoredAtKey = "_watermill_inbox_outbox_stored_at"

// Outbox wraps an inbox.Outbox (set the result as Config.Outbox) so that each stored message
// carries the time it was stored (StoredAtKey), from which RelayPublisher measures the relay
// lag. The caller's messages are not modified: copies are stored.
func (m *Metrics) Outbox(o inbox.Outbox) inbox.Outbox {
	return stampingOutbox{o: o}
}

type stampingOutbox struct{ o inbox.Outbox }

func (s stampingOutbox) Store(ctx context.Context, topic string, msgs []*message.Message) error {
	now := strconv.FormatInt(time.Now().UnixNano(), 10)
	copies := make([]*message.Message, len(msgs))
	for i, msg := range msgs {
		if msg == nil {
			continue // the outbox refuses it with its own error
		}
		c := message.NewMessage(msg.UUID, msg.Payload)
		c.Metadata = make(message.Metadata, len(msg.Metadata)+1)
		for k, v := range msg.Metadata {
			c.Metadata[k] = v
		}
		c.Metadata[StoredAtKey] = now
		c.SetContext(msg.Context())
		copies[i] = c
	}
	return s.o.Store(ctx, topic, copies)
}

// RelayPublisher wraps the outbox relay's publisher (outbox.RelayConfig.Publisher): every
// message it publishes successfully is counted in outbox_relayed_messages_total, its relay lag
// observed when it carries StoredAtKey (which is removed before the publish), and every failed
// publish counted in outbox_relay_publish_errors_total. Close closes pub.
func (m *Metrics) RelayPublisher(pub message.Publisher) message.Publisher {
	return relayPublisher{m: m, pub: pub}
}

type relayPublisher struct {
	m   *Metrics
	pub message.Publisher
}

func (p relayPublisher) Publish(topic string, msgs ...*message.Message) error {
	label := p.m.topic(p.m.relayTopics, topic)
	stored := make([]int64, len(msgs))
	for i, msg := range msgs {
		if msg == nil || msg.Metadata == nil {
			continue
		}
		if v, ok := msg.Metadata[StoredAtKey]; ok {
			stored[i], _ = strconv.ParseInt(v, 10, 64)
			delete(msg.Metadata, StoredAtKey)
		}
	}
	if err := p.pub.Publish(topic, msgs...); err != nil {
		p.m.relayErrors.WithLabelValues(label).Inc()
		return err
	}
	now := time.Now()
	p.m.relayed.WithLabelValues(label).Add(float64(len(msgs)))
	for _, ns := range stored {
		if ns > 0 {
			p.m.relayLag.WithLabelValues(label).Observe(max(0, now.Sub(time.Unix(0, ns)).Seconds()))
		}
	}
	return nil
}

func (p relayPublisher) Close() error { return p.pub.Close() }
