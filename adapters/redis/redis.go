// Package redis connects the inbox to Redis Streams through watermill-redisstream v1.4 and
// go-redis v9, with consumer groups.
//
// # Where the producer's ID travels
//
// watermill-redisstream stores a message as one stream entry with three fields:
// `_watermill_message_uuid` (the UUID), `payload`, and `metadata` (msgpack-encoded). Its default
// unmarshaler fails on an entry without the UUID field, and a failed unmarshal ENDS the
// subscription (the entry stays pending, is claimed by the next subscriber after MaxIdleTime,
// and ends that one too). This adapter's Unmarshaller never fails: a missing UUID field becomes
// an empty UUID, and an entry whose metadata cannot be decoded is delivered with an empty UUID
// and the decoding error in metadata UnmarshalErrorKey. The inbox refuses an empty UUID as a
// permanent error (dead-lettered when a dead-letter topic is set).
//
// # Delivery semantics
//
// Each topic is a stream, created with the consumer group on first subscribe (XGROUP CREATE
// MKSTREAM, from StartID: by default the first entry, so a new group reads what was published
// before it existed). Every subscription reads new entries with XREADGROUP as Consumer; an
// entry stays in the group's pending list until the router acks it (XACK, after the inbox
// commit).
//
//   - A Nack does not go back to Redis: watermill-redisstream hands the same message to the
//     same subscription again after NackResendSleep, until it is acked. A failing message
//     blocks its subscription meanwhile (bound it with the inbox's MaxAttempts and a
//     dead-letter topic).
//   - An entry left pending by a consumer that crashed or was killed is claimed (XCLAIM) by a
//     live subscription of the group once it has been idle for MaxIdleTime; every
//     subscription looks for such entries at start and every ClaimInterval. The consumer name
//     does not matter: a restarted process with a new name claims its predecessor's entries.
//     MaxIdleTime must exceed the longest time an entry waits and runs in a live consumer
//     (each subscription reads up to two entries ahead, and nack loops count too): an entry
//     claimed from a live consumer is delivered twice, a duplicate the inbox absorbs.
//   - Consumers idle for ten minutes with nothing pending are removed from the group.
//   - The broker's Redelivery tells the inbox which deliveries may follow an earlier run of
//     the handler: an entry taken over with XCLAIM is Redelivered, one read with XREADGROUP is
//     a FirstDelivery, the copy re-sent after a nack RedeliveryUnknown (redelivery.go,
//     ReadKey; docs/adapters.md, "Redis Streams' first-delivery signal").
//
// Defaults: MaxIdleTime 15 s and ClaimInterval 1 s (watermill-redisstream's 60 s and 5 s left
// a killed consumer's entries unprocessed for over a minute; docs/operations.md), and
// NackResendSleep 1 s. The tests use 1 s, 200 ms and 20 ms.
//
// Streams are not trimmed unless MaxLen is set; see its warning. Redis must persist (AOF or
// RDB): a server restarted empty loses the streams, the groups and the pending entries, and
// subscriptions then fail with NOGROUP until they are restarted.
package redis

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	goredis "github.com/redis/go-redis/v9"
	"github.com/vmihailenco/msgpack"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Name is the adapter's name in router configuration, registered when the package is imported
// (driver.go).
const Name = "redis"

// UnmarshalErrorKey is the metadata field that holds why an entry's metadata could not be
// decoded; such a message is delivered with an empty UUID.
const UnmarshalErrorKey = "_watermill_inbox_unmarshal_error"

// BrokerSideFields are the names under which Redis' delivery state would reach message
// metadata. Only ReadKey does with this adapter (its mark on each read, for Redelivery): the
// entry ID and the pending list's delivery counter stay inside watermill-redisstream; their
// names are those a custom unmarshaler would use.
var BrokerSideFields = brokerside.Redis

// Defaults of MaxIdleTime and ClaimInterval (see Config): a killed consumer's pending entries
// are claimed by a live subscription between 15 and 16 s after their last delivery.
const (
	DefaultMaxIdleTime   = 15 * time.Second
	DefaultClaimInterval = time.Second
)

// Config configures the Redis Streams broker.
type Config struct {
	// URL is the Redis URL (required), e.g. redis://127.0.0.1:6379/0 or rediss://... for TLS.
	URL string
	// ConsumerGroup is the stream consumer group (required): subscriptions in one group share
	// the entries, each group gets every entry.
	ConsumerGroup string
	// Consumer names this process's consumer in the group. Default: host name, process ID and
	// a random suffix.
	Consumer string
	// StartID is where a group created by the first subscribe starts: "0" (default) reads the
	// whole stream, "$" only entries added afterwards.
	StartID string
	// NackResendSleep is the pause before a nacked message is handed to the subscription
	// again. Default: 1 s.
	NackResendSleep time.Duration
	// MaxIdleTime is how long an entry stays pending before another subscription of the group
	// claims it: the delay before the entries a killed consumer held are processed (the rest
	// of the group's entries keep flowing to live consumers meanwhile). An entry still in a
	// live consumer's hands past it is delivered twice, a duplicate the inbox absorbs.
	// Default: DefaultMaxIdleTime.
	MaxIdleTime time.Duration
	// ClaimInterval is how often each subscription looks for entries idle for MaxIdleTime.
	// Default: DefaultClaimInterval.
	ClaimInterval time.Duration
	// MaxLen trims each stream the publisher writes to about this many entries (XADD MAXLEN ~).
	// Trimming removes the oldest entries whether or not every group has consumed them: an
	// entry trimmed while pending or unread is lost (watermill-redisstream acks a claimed entry
	// that no longer exists). Default: 0, never trimmed.
	MaxLen int64
}

func (c *Config) setDefaults() {
	if c.Consumer == "" {
		host, _ := os.Hostname()
		c.Consumer = fmt.Sprintf("%s-%d-%s", host, os.Getpid(), watermill.NewShortUUID()[:8])
	}
	if c.StartID == "" {
		c.StartID = "0"
	}
	if c.NackResendSleep == 0 {
		c.NackResendSleep = time.Second
	}
	if c.MaxIdleTime == 0 {
		c.MaxIdleTime = DefaultMaxIdleTime
	}
	if c.ClaimInterval == 0 {
		c.ClaimInterval = DefaultClaimInterval
	}
}

// Validate returns an error wrapping inbox.ErrInvalidConfig for an empty URL or
// ConsumerGroup, or negative values.
func (c Config) Validate() error {
	switch {
	case c.URL == "":
		return fmt.Errorf("%w: redis adapter: URL is required", inbox.ErrInvalidConfig)
	case c.ConsumerGroup == "":
		return fmt.Errorf("%w: redis adapter: ConsumerGroup is required (without one, watermill-redisstream fans out without acks)", inbox.ErrInvalidConfig)
	case c.NackResendSleep < 0 || c.MaxIdleTime < 0 || c.ClaimInterval < 0 || c.MaxLen < 0:
		return fmt.Errorf("%w: redis adapter: negative NackResendSleep, MaxIdleTime, ClaimInterval or MaxLen", inbox.ErrInvalidConfig)
	}
	if _, err := goredis.ParseURL(c.URL); err != nil {
		return fmt.Errorf("%w: redis adapter: URL %s: %v", inbox.ErrInvalidConfig, redact.URL(c.URL), redact.Err(err, c.URL))
	}
	return nil
}

// New connects (one client for the publisher, one for the subscriber: each closes its own),
// checks the server answers, and returns the broker.
func New(cfg Config, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	// The URL's password never reaches a log line or an error (internal/redact).
	logger = redact.Logger(logger, cfg.URL)
	sub, err := newSubscriber(cfg, logger)
	if err != nil {
		return nil, err
	}
	pubOpts, _ := goredis.ParseURL(cfg.URL) // a client keeps and initialises its options: one each
	pub, err := redisstream.NewPublisher(redisstream.PublisherConfig{
		Client:        goredis.NewClient(pubOpts),
		Marshaller:    redisstream.DefaultMarshallerUnmarshaller{},
		DefaultMaxlen: cfg.MaxLen,
	}, logger)
	if err != nil {
		_ = sub.Close()
		return nil, fmt.Errorf("redis adapter: publisher: %w", err)
	}
	return &adapters.Broker{
		Name: Name, Publisher: pub, Subscriber: sub,
		NewSubscriber: func(group string) (message.Subscriber, error) {
			gc := cfg
			gc.ConsumerGroup = group
			if err := gc.Validate(); err != nil {
				return nil, err
			}
			return newSubscriber(gc, logger)
		},
		BrokerSideFields: BrokerSideFields,
		Redelivery:       Redelivery,
	}, nil
}

// newSubscriber connects a client of its own (closed with the subscriber), checks the server
// answers, and returns a subscriber of cfg.ConsumerGroup whose claimed (XCLAIM) entries are
// marked for Redelivery (claimHook).
func newSubscriber(cfg Config, logger watermill.LoggerAdapter) (message.Subscriber, error) {
	opts, _ := goredis.ParseURL(cfg.URL)
	subClient := goredis.NewClient(opts)
	subClient.AddHook(claimHook{})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := subClient.Ping(ctx).Err(); err != nil {
		_ = subClient.Close()
		return nil, fmt.Errorf("redis adapter: %s: %w", redact.URL(cfg.URL), redact.Err(err, cfg.URL))
	}
	sub, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client:                        subClient,
		Unmarshaller:                  Unmarshaller{},
		Consumer:                      cfg.Consumer,
		ConsumerGroup:                 cfg.ConsumerGroup,
		NackResendSleep:               cfg.NackResendSleep,
		ClaimInterval:                 cfg.ClaimInterval,
		MaxIdleTime:                   cfg.MaxIdleTime,
		OldestId:                      cfg.StartID,
		DisableIndefiniteInitialBlock: true, // else Close may leave a reader blocked for good
	}, logger)
	if err != nil {
		_ = subClient.Close()
		return nil, fmt.Errorf("redis adapter: subscriber: %w", err)
	}
	return sub, nil
}

// Unmarshaller reads entries written by watermill-redisstream's DefaultMarshallerUnmarshaller
// and never fails, because a failed unmarshal ends watermill-redisstream's subscription:
//
//   - a missing `_watermill_message_uuid` field gives an empty UUID (refused by the inbox);
//   - a missing payload gives an empty payload;
//   - undecodable metadata gives an empty UUID and metadata holding only UnmarshalErrorKey
//     (with the UUID the entry carried), so the inbox refuses it rather than a handler running
//     without the metadata its producer sent.
//
// Every message it returns carries ReadKey (a producer's value under that name is replaced),
// the mark Redelivery reads: "claimed" for an entry claimHook marked as taken over with XCLAIM,
// "1" otherwise.
type Unmarshaller struct{}

// Unmarshal implements redisstream.Unmarshaller. It never returns an error.
func (Unmarshaller) Unmarshal(values map[string]any) (*message.Message, error) {
	uuid := str(values[redisstream.UUIDHeaderKey])
	msg := message.NewMessage(uuid, []byte(str(values["payload"])))
	if raw := str(values["metadata"]); raw != "" {
		md := make(message.Metadata)
		if err := msgpack.Unmarshal([]byte(raw), &md); err != nil {
			msg.UUID = ""
			md = message.Metadata{UnmarshalErrorKey: fmt.Sprintf("entry with UUID %q: metadata: %v", uuid, err)}
		}
		msg.Metadata = md
	}
	// The redelivery mark, whatever the producer's metadata held under ReadKey.
	if str(values[claimedField]) != "" {
		msg.Metadata.Set(ReadKey, readClaimed)
	} else {
		msg.Metadata.Set(ReadKey, readFresh)
	}
	return msg, nil
}

// str returns a stream field's value as a string ("" when absent).
func str(v any) string {
	switch v := v.(type) {
	case nil:
		return ""
	case string:
		return v
	case []byte:
		return string(v)
	default:
		return fmt.Sprint(v)
	}
}
