// Package nats connects the inbox to NATS JetStream through watermill-nats v2 (pkg/nats, with
// JetStream on).
//
// # Where the producer's ID travels
//
// Watermill's NATSMarshaler sends the message UUID in the NATS header `_watermill_message_uuid`
// and every metadata field as a header of its own. A message without that header (published
// by a plain NATS client) is delivered with an empty UUID, which the inbox refuses as a
// permanent error (an *inbox.InvalidKeyError: dead-lettered when a dead-letter topic is set).
//
// # Topology and delivery semantics
//
// Each topic is a stream of the same name with the topic as its only subject (so a topic must
// be a valid stream name: no '.', '*', '>', '/', '\' or whitespace). The publisher creates the
// stream before its first publish to a topic, so a dead letter or an outbox relay never
// publishes into nothing; JetStream then acknowledges every publish once it is stored.
//
// A consumer group is one durable push consumer on the topic's stream, named after the group,
// with the group as its deliver (queue) group: every subscription of every process in the
// group binds to it, and JetStream hands each message to one of them. The adapter creates the
// consumer itself before subscribing, with explicit acks, AckWait, MaxAckPending, unlimited
// deliveries and DeliverAll (a new group reads the stream from its first retained message).
//
// Acks are sent only when the router acks, that is after the inbox commit, and synchronously
// (AckSync: the ack is confirmed by the server). A Nack is a JetStream NAK: the message is
// redelivered at once, or after NakDelay. A message neither acked nor nacked within AckWait (a
// crashed or killed process, a handler slower than AckWait, a subscriber closed mid-message) is
// redelivered by the server to any member of the group, so AckWait must exceed the longest
// handler run including the inbox's lock waits. The number of attempts is the inbox's business
// (Config.MaxAttempts there); JetStream's MaxDeliver is left unlimited.
//
// Two defaults of watermill-nats and nats.go are overridden, both of which lose messages:
//
//   - Without nats.ManualAck, nats.go acks every JetStream message when the subscription's
//     callback returns, and watermill-nats returns from it without acking when the subscriber
//     is closing, the subscription's context is cancelled or its own ack timeout passes. Those
//     messages would be acked unprocessed. This adapter subscribes with ManualAck: they are
//     redelivered after AckWait.
//   - When nats.go creates the durable consumer during a subscribe, it deletes it again when
//     that subscription ends (Unsubscribe), taking the group's position and pending messages
//     with it while other members still use it. This adapter creates the consumer beforehand,
//     so no subscription owns it.
//
// The stream's own duplicate window (Nats-Msg-Id, watermill-nats' TrackMsgId) is not used: it
// is a time window of the broker, not a guarantee; the inbox is the deduplication.
package nats

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	natsgo "github.com/nats-io/nats.go"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Name is the adapter's name in router configuration, registered when the package is imported
// (driver.go).
const Name = "nats"

// BrokerSideFields are the names under which JetStream's delivery state reaches message
// metadata. JetStream's delivery count and sequences travel in the reply subject of each
// delivery (nats.Msg.Metadata), which watermill-nats does not expose; this adapter's
// Unmarshaler copies the delivery count into NumDeliveredKey. The other lower-case names are
// the ones a custom unmarshaler copying that metadata would naturally use;
// the Nats-* headers are those the server itself writes into a message it republishes
// (stream RePublish), sources from another stream, or returns by direct get.
var BrokerSideFields = brokerside.NATS

// DefaultAckWait is Config.AckWait's default: 10 s, a third of watermill-nats' 30 s, which
// stalled a consumer group for about 30 s after each SIGKILLed consumer (docs/operations.md).
const DefaultAckWait = 10 * time.Second

// Config configures the NATS JetStream broker.
type Config struct {
	// URL is the NATS server URL (required), e.g. nats://127.0.0.1:4222; several are
	// separated by commas.
	URL string
	// ConsumerGroup is the durable consumer's name and its deliver group (required): the
	// subscriptions of every process in the group share the messages, each group gets every
	// message. A valid consumer name: no '.', '*', '>', '/', '\' or whitespace.
	ConsumerGroup string
	// AckWait is how long JetStream waits for the ack of a delivery before redelivering it,
	// and how long the subscriber waits for the router's Ack or Nack. It must exceed the
	// longest handler run; it is also the delay before a crashed consumer's messages are
	// redelivered. Default: DefaultAckWait. A change is applied to an existing consumer on
	// subscribe.
	//
	// After a consumer process is killed, the messages it held (up to MaxAckPending, all of
	// them under load) are redelivered only after AckWait, and while it held every
	// MaxAckPending slot the whole group receives nothing: a killed consumer stalls its group
	// for about AckWait (measured in docs/operations.md). Set it a few times above the
	// handler's slowest expected run, inbox lock waits included; a slower run is redelivered
	// to another member while it runs, a concurrent duplicate the inbox absorbs (the copy
	// waits on the claim, then is skipped), at the cost of wasted work. watermill-nats
	// v2.1.3 gives the handler no access to the JetStream message, so in-progress acks
	// (msg.InProgress, which would let a slow handler extend AckWait) are not available.
	AckWait time.Duration
	// MaxAckPending caps the unacked messages of the whole group. The server pushes up to that
	// many to the subscriptions, where they queue while AckWait runs: keep it near the group's
	// number of subscriptions times a few, or messages queued behind slow ones are redelivered
	// (duplicates the inbox absorbs, but wasted work). Default: 64. Applied like AckWait.
	MaxAckPending int
	// NakDelay delays the redelivery of a nacked message. Default: 0 (at once).
	NakDelay time.Duration
	// SubscribersCount is the number of concurrent JetStream subscriptions each Subscribe call
	// opens (each handles one message at a time). Default: 1.
	SubscribersCount int
	// Stream is the template of the stream created for a topic that has none: Name and
	// Subjects are set from the topic; the zero value is a file-backed stream with limits
	// retention and no limits. Set MaxAge or MaxBytes to bound it (a message removed by a limit
	// before its group consumed it is lost). An existing stream is used as it is.
	Stream natsgo.StreamConfig
	// NatsOptions are passed to nats.Connect (credentials, TLS, reconnect policy). The adapter
	// adds a connection name and unlimited reconnects before them.
	NatsOptions []natsgo.Option
}

func (c *Config) setDefaults() {
	if c.AckWait == 0 {
		c.AckWait = DefaultAckWait
	}
	if c.MaxAckPending == 0 {
		c.MaxAckPending = 64
	}
	if c.SubscribersCount == 0 {
		c.SubscribersCount = 1
	}
}

// Validate returns an error wrapping inbox.ErrInvalidConfig for an empty URL, a missing or
// invalid ConsumerGroup, or negative values.
func (c Config) Validate() error {
	switch {
	case c.URL == "":
		return fmt.Errorf("%w: nats adapter: URL is required", inbox.ErrInvalidConfig)
	case c.ConsumerGroup == "":
		return fmt.Errorf("%w: nats adapter: ConsumerGroup is required", inbox.ErrInvalidConfig)
	case !validName(c.ConsumerGroup):
		return fmt.Errorf("%w: nats adapter: ConsumerGroup %q is not a valid JetStream consumer name", inbox.ErrInvalidConfig, c.ConsumerGroup)
	case c.AckWait < 0 || c.NakDelay < 0 || c.MaxAckPending < 0 || c.SubscribersCount < 0:
		return fmt.Errorf("%w: nats adapter: negative AckWait, NakDelay, MaxAckPending or SubscribersCount", inbox.ErrInvalidConfig)
	}
	return nil
}

// validName reports whether s is a valid JetStream stream or consumer name.
func validName(s string) bool {
	return s != "" && !strings.ContainsAny(s, ".*>/\\ \t\r\n")
}

// New connects the publisher and the subscriber (one connection each) and returns the broker.
// It fails when the server cannot be reached or has JetStream disabled.
func New(cfg Config, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	// The URLs' passwords never reach a log line or an error (internal/redact).
	logger = redact.Logger(logger, natsURLs(cfg.URL)...)
	opts := append([]natsgo.Option{natsgo.Name("watermill-inbox"), natsgo.MaxReconnects(-1)}, cfg.NatsOptions...)

	sub, err := newSubscriber(cfg, opts, logger)
	if err != nil {
		return nil, err
	}

	pubConn, err := natsgo.Connect(cfg.URL, opts...)
	if err != nil {
		_ = sub.Close()
		return nil, fmt.Errorf("nats adapter: connect to %s: %w", redactedURLs(cfg.URL), redact.Err(err, natsURLs(cfg.URL)...))
	}
	pubJS, err := jetStream(pubConn)
	if err != nil {
		pubConn.Close()
		_ = sub.Close()
		return nil, err
	}
	pub, err := wmnats.NewPublisherWithNatsConn(pubConn, wmnats.PublisherPublishConfig{
		Marshaler:         &wmnats.NATSMarshaler{},
		SubjectCalculator: wmnats.DefaultSubjectCalculator,
	}, logger)
	if err != nil {
		pubConn.Close()
		_ = sub.Close()
		return nil, fmt.Errorf("nats adapter: publisher: %w", err)
	}
	return &adapters.Broker{
		Name:       Name,
		Publisher:  &publisher{Publisher: pub, streams: &streams{js: pubJS, template: cfg.Stream}},
		Subscriber: sub,
		NewSubscriber: func(group string) (message.Subscriber, error) {
			gc := cfg
			gc.ConsumerGroup = group
			if err := gc.Validate(); err != nil {
				return nil, err
			}
			return newSubscriber(gc, opts, logger)
		},
		BrokerSideFields: BrokerSideFields,
		Redelivery:       Redelivery,
	}, nil
}

// newSubscriber connects a subscriber of cfg.ConsumerGroup on a connection of its own (closed
// with it).
func newSubscriber(cfg Config, opts []natsgo.Option, logger watermill.LoggerAdapter) (*subscriber, error) {
	subConn, err := natsgo.Connect(cfg.URL, opts...)
	if err != nil {
		return nil, fmt.Errorf("nats adapter: connect to %s: %w", redactedURLs(cfg.URL), redact.Err(err, natsURLs(cfg.URL)...))
	}
	subJS, err := jetStream(subConn)
	if err != nil {
		subConn.Close()
		return nil, err
	}
	subCfg := wmnats.SubscriberSubscriptionConfig{
		Unmarshaler:      Unmarshaler{},
		SubscribersCount: cfg.SubscribersCount,
		AckWaitTimeout:   cfg.AckWait,
		CloseTimeout:     10 * time.Second,
		QueueGroupPrefix: cfg.ConsumerGroup, // the deliver group
		JetStream: wmnats.JetStreamConfig{
			DurablePrefix:    cfg.ConsumerGroup, // binds to the consumer ensureConsumer made
			SubscribeOptions: []natsgo.SubOpt{natsgo.ManualAck()},
		},
	}
	if cfg.NakDelay > 0 {
		subCfg.NakDelay = wmnats.NewStaticDelay(cfg.NakDelay)
	}
	sub, err := wmnats.NewSubscriberWithNatsConn(subConn, subCfg, logger)
	if err != nil {
		subConn.Close()
		return nil, fmt.Errorf("nats adapter: subscriber: %w", err)
	}
	return &subscriber{Subscriber: sub, streams: &streams{js: subJS, template: cfg.Stream}, cfg: cfg}, nil
}

// natsURLs splits Config.URL, a comma-separated list of server URLs (nats.Connect's form).
func natsURLs(list string) []string {
	urls := strings.Split(list, ",")
	for i := range urls {
		urls[i] = strings.TrimSpace(urls[i])
	}
	return urls
}

// redactedURLs is Config.URL for errors, each URL's password masked (internal/redact.URL).
func redactedURLs(list string) string {
	urls := natsURLs(list)
	for i, u := range urls {
		urls[i] = redact.URL(u)
	}
	return strings.Join(urls, ",")
}

// jetStream returns conn's JetStream context after checking that the server has JetStream on.
func jetStream(conn *natsgo.Conn) (natsgo.JetStreamContext, error) {
	js, err := conn.JetStream()
	if err == nil {
		_, err = js.AccountInfo()
	}
	if err != nil {
		return nil, fmt.Errorf("nats adapter: JetStream unavailable at %s (start nats-server with -js): %w", conn.ConnectedUrlRedacted(), err)
	}
	return js, nil
}

// streams creates each topic's stream once per process.
type streams struct {
	js       natsgo.JetStreamContext
	template natsgo.StreamConfig
	mu       sync.Mutex
	ready    map[string]bool
}

func (s *streams) ensure(topic string) error {
	if !validName(topic) {
		return fmt.Errorf("nats adapter: topic %q is not a valid JetStream stream name (no '.', '*', '>', '/', '\\' or whitespace)", topic)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ready[topic] {
		return nil
	}
	_, err := s.js.StreamInfo(topic)
	if errors.Is(err, natsgo.ErrStreamNotFound) {
		cfg := s.template
		cfg.Name, cfg.Subjects = topic, []string{topic}
		if _, err = s.js.AddStream(&cfg); err != nil {
			// Another process may have created it meanwhile.
			if _, ierr := s.js.StreamInfo(topic); ierr == nil {
				err = nil
			}
		}
	}
	if err != nil {
		return fmt.Errorf("nats adapter: stream %q: %w", topic, err)
	}
	if s.ready == nil {
		s.ready = map[string]bool{}
	}
	s.ready[topic] = true
	return nil
}

// publisher creates a topic's stream before the first publish to it: JetStream refuses a
// publish no stream listens to.
type publisher struct {
	*wmnats.Publisher
	streams *streams
}

// Publish implements message.Publisher.
func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.streams.ensure(topic); err != nil {
		return err
	}
	return p.Publisher.Publish(topic, msgs...)
}

// subscriber creates the topic's stream and the group's durable consumer before subscribing.
type subscriber struct {
	*wmnats.Subscriber
	streams *streams
	cfg     Config
	mu      sync.Mutex
	ready   map[string]bool
}

// SubscribeInitialize creates the topic's stream and the group's consumer when missing, and
// updates the consumer's AckWait and MaxAckPending when they differ from the configuration.
func (s *subscriber) SubscribeInitialize(topic string) error {
	if err := s.streams.ensure(topic); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ready[topic] {
		return nil
	}
	if err := s.ensureConsumer(topic); err != nil {
		return fmt.Errorf("nats adapter: consumer %q on stream %q: %w", s.cfg.ConsumerGroup, topic, err)
	}
	if s.ready == nil {
		s.ready = map[string]bool{}
	}
	s.ready[topic] = true
	return nil
}

func (s *subscriber) ensureConsumer(topic string) error {
	js, group := s.streams.js, s.cfg.ConsumerGroup
	info, err := js.ConsumerInfo(topic, group)
	if errors.Is(err, natsgo.ErrConsumerNotFound) {
		_, err = js.AddConsumer(topic, &natsgo.ConsumerConfig{
			Durable:        group,
			DeliverSubject: natsgo.NewInbox(),
			DeliverGroup:   group,
			DeliverPolicy:  natsgo.DeliverAllPolicy,
			FilterSubject:  topic,
			AckPolicy:      natsgo.AckExplicitPolicy,
			AckWait:        s.cfg.AckWait,
			MaxDeliver:     -1,
			MaxAckPending:  s.cfg.MaxAckPending,
		})
		if err == nil {
			return nil
		}
		// Another process may have created it meanwhile (with its own deliver subject).
		if info, err = js.ConsumerInfo(topic, group); err != nil {
			return err
		}
	}
	if err != nil {
		return err
	}
	if info.Config.AckWait != s.cfg.AckWait || info.Config.MaxAckPending != s.cfg.MaxAckPending {
		upd := info.Config
		upd.AckWait, upd.MaxAckPending = s.cfg.AckWait, s.cfg.MaxAckPending
		_, err = js.UpdateConsumer(topic, &upd)
	}
	return err
}

// Subscribe implements message.Subscriber: it runs SubscribeInitialize, then subscribes to
// the group's consumer.
func (s *subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if err := s.SubscribeInitialize(topic); err != nil {
		return nil, err
	}
	return s.Subscriber.Subscribe(ctx, topic)
}

// Unmarshaler is watermill-nats' NATSMarshaler.Unmarshal without its failure: a header with
// several values keeps its first one instead of failing the message, because watermill-nats
// drops a message it cannot unmarshal without acking it, and JetStream then redelivers it every
// AckWait, forever. The UUID is the `_watermill_message_uuid` header, empty when missing; the
// other headers become metadata, except the reserved publish headers (Nats-Msg-Id,
// Nats-Expected-*).
type Unmarshaler struct{}

// Unmarshal implements watermill-nats' Unmarshaler. It never returns an error.
func (Unmarshaler) Unmarshal(m *natsgo.Msg) (*message.Message, error) {
	md := make(message.Metadata, len(m.Header))
	for k, v := range m.Header {
		switch k {
		case wmnats.WatermillUUIDHdr, natsgo.MsgIdHdr, natsgo.ExpectedLastMsgIdHdr, natsgo.ExpectedStreamHdr,
			natsgo.ExpectedLastSubjSeqHdr, natsgo.ExpectedLastSeqHdr:
			continue
		}
		if len(v) > 0 {
			md.Set(k, v[0])
		}
	}
	// The delivery count comes from JetStream's ack metadata (the reply subject), never from a
	// header a producer could have sent under the same name.
	delete(md, NumDeliveredKey)
	if meta, err := m.Metadata(); err == nil && meta.NumDelivered > 0 {
		md.Set(NumDeliveredKey, strconv.FormatUint(meta.NumDelivered, 10))
	}
	msg := message.NewMessage(m.Header.Get(wmnats.WatermillUUIDHdr), m.Data)
	msg.Metadata = md
	return msg, nil
}

// NumDeliveredKey is the metadata field in which Unmarshaler puts JetStream's delivery count
// of the message for its consumer (nats.MsgMetadata.NumDelivered, from the delivery's ack
// reply subject): "1" on the first delivery, counting up on every redelivery (nack, AckWait
// expired). It is absent when the message carries no JetStream ack metadata. It is a
// broker-side field: never a key, removed from dead letters.
const NumDeliveredKey = "num_delivered"

// Redelivery is the adapter's inbox.RedeliveryFunc: JetStream's delivery count
// (NumDeliveredKey) of 1 is inbox.FirstDelivery, above 1 inbox.Redelivered, missing or
// unreadable inbox.RedeliveryUnknown. JetStream counts every delivery of the message to the
// durable consumer, so a count of 1 means no earlier delivery to that consumer group.
func Redelivery(msg *message.Message) inbox.Redelivery {
	n, err := strconv.ParseUint(msg.Metadata.Get(NumDeliveredKey), 10, 64)
	switch {
	case err != nil || n == 0:
		return inbox.RedeliveryUnknown
	case n == 1:
		return inbox.FirstDelivery
	default:
		return inbox.Redelivered
	}
}
