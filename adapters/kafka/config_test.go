package kafka_test

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/adapters/kafka"
	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// TestSubscriberConfigIsAtLeastOnce checks the sarama settings the adapter derives: only
// acked records are committed (sarama auto-commit commits only watermill-kafka's post-ack
// marks, or watermill-kafka commits synchronously after each ack), and a new group starts at
// the oldest record instead of skipping what was published before it joined.
func TestSubscriberConfigIsAtLeastOnce(t *testing.T) {
	sc, err := kafka.Config{Brokers: []string{"127.0.0.1:9092"}, ConsumerGroup: "billing"}.SubscriberConfig()
	if err != nil {
		t.Fatal(err)
	}
	s := sc.OverwriteSaramaConfig
	if !s.Consumer.Offsets.AutoCommit.Enable || s.Consumer.Offsets.AutoCommit.Interval != kafka.DefaultCommitInterval {
		t.Errorf("auto-commit = %v every %s, want on every %s", s.Consumer.Offsets.AutoCommit.Enable, s.Consumer.Offsets.AutoCommit.Interval, kafka.DefaultCommitInterval)
	}
	if s.Consumer.Offsets.Initial != sarama.OffsetOldest {
		t.Errorf("initial offset = %d, want OffsetOldest", s.Consumer.Offsets.Initial)
	}
	if !s.Consumer.Return.Errors {
		t.Error("Consumer.Return.Errors is off: watermill-kafka would not see consumer errors")
	}
	if s.Version != sarama.DefaultVersion || s.ClientID != kafka.DefaultClientID {
		t.Errorf("version %s client %q, want %s %q", s.Version, s.ClientID, sarama.DefaultVersion, kafka.DefaultClientID)
	}
	if s.Consumer.Group.Session.Timeout != kafka.DefaultSessionTimeout || s.Consumer.Group.Heartbeat.Interval != kafka.DefaultHeartbeatInterval ||
		s.Consumer.Group.Rebalance.Timeout != kafka.DefaultRebalanceTimeout {
		t.Errorf("group timeouts %s/%s/%s", s.Consumer.Group.Session.Timeout, s.Consumer.Group.Heartbeat.Interval, s.Consumer.Group.Rebalance.Timeout)
	}
	if sc.ConsumerGroup != "billing" {
		t.Errorf("group %q", sc.ConsumerGroup)
	}
	// The Unmarshaler is the DefaultMarshaler behind the first-delivery signal's wrapper, and
	// the Tracer hook carries the signal's consumer-group handler.
	rec := &sarama.ConsumerMessage{Value: []byte("p"), Headers: []*sarama.RecordHeader{{Key: []byte(wmkafka.UUIDHeaderKey), Value: []byte("u-1")}}}
	if m, err := sc.Unmarshaler.Unmarshal(rec); err != nil || m.UUID != "u-1" || string(m.Payload) != "p" {
		t.Errorf("unmarshaler %T: %v, %v", sc.Unmarshaler, m, err)
	}
	if sc.Tracer == nil {
		t.Error("no Tracer: the first-delivery signal is not installed")
	}
	if sc.NackResendSleep != kafka.DefaultNackResendSleep || sc.ReconnectRetrySleep != kafka.DefaultReconnectRetrySleep {
		t.Errorf("sleeps %s %s", sc.NackResendSleep, sc.ReconnectRetrySleep)
	}

	sc, err = kafka.Config{Brokers: []string{"b:9092"}, ConsumerGroup: "g", CommitInterval: kafka.CommitEveryAck}.SubscriberConfig()
	if err != nil {
		t.Fatal(err)
	}
	if sc.OverwriteSaramaConfig.Consumer.Offsets.AutoCommit.Enable {
		t.Error("CommitEveryAck must turn sarama's auto-commit off (watermill-kafka then commits after every ack)")
	}

	sc, err = kafka.Config{Brokers: []string{"b:9092"}, ConsumerGroup: "g", SessionTimeout: 3 * time.Second, FetchMaxWait: 50 * time.Millisecond}.SubscriberConfig()
	if err != nil {
		t.Fatal(err)
	}
	if hb := sc.OverwriteSaramaConfig.Consumer.Group.Heartbeat.Interval; hb != time.Second {
		t.Errorf("heartbeat for a 3s session = %s, want 1s (a third)", hb)
	}
	if w := sc.OverwriteSaramaConfig.Consumer.MaxWaitTime; w != 50*time.Millisecond {
		t.Errorf("fetch max wait = %s, want 50ms", w)
	}

	pc, err := kafka.Config{Brokers: []string{"b:9092"}}.PublisherConfig()
	if err != nil {
		t.Fatal(err)
	}
	if p := pc.OverwriteSaramaConfig.Producer; p.RequiredAcks != sarama.WaitForAll || !p.Return.Successes || p.Retry.Max != kafka.DefaultProducerRetries {
		t.Errorf("producer acks=%d successes=%v retries=%d", p.RequiredAcks, p.Return.Successes, p.Retry.Max)
	}
	if _, ok := pc.Marshaler.(wmkafka.DefaultMarshaler); !ok {
		t.Errorf("marshaler %T, want DefaultMarshaler", pc.Marshaler)
	}

	// PartitionKey keys records; an empty key means no key (a random partition), unlike
	// watermill-kafka's partitioning marshaler. The producer's ID travels in the
	// _watermill_message_uuid header either way.
	pk := kafka.Config{Brokers: []string{"b:9092"}, PartitionKey: func(_ string, m *message.Message) (string, error) {
		return m.Metadata.Get("account"), nil
	}}
	pc, err = pk.PublisherConfig()
	if err != nil {
		t.Fatal(err)
	}
	keyed := message.NewMessage("id-1", []byte("{}"))
	keyed.Metadata.Set("account", "acct-7")
	for _, tc := range []struct {
		msg     *message.Message
		wantKey string
	}{{keyed, "acct-7"}, {message.NewMessage("id-2", []byte("{}")), ""}} {
		rec, err := pc.Marshaler.Marshal("payments", tc.msg)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case tc.wantKey == "" && rec.Key != nil:
			t.Errorf("%s: record key %v, want none", tc.msg.UUID, rec.Key)
		case tc.wantKey != "":
			if rec.Key == nil {
				t.Errorf("%s: no record key, want %q", tc.msg.UUID, tc.wantKey)
			} else if k, _ := rec.Key.Encode(); string(k) != tc.wantKey {
				t.Errorf("%s: record key %q, want %q", tc.msg.UUID, k, tc.wantKey)
			}
		}
		if len(rec.Headers) == 0 || string(rec.Headers[0].Key) != wmkafka.UUIDHeaderKey || string(rec.Headers[0].Value) != tc.msg.UUID {
			t.Errorf("headers %v, want %s=%s first", rec.Headers, wmkafka.UUIDHeaderKey, tc.msg.UUID)
		}
		back, err := pc.Marshaler.(wmkafka.Unmarshaler).Unmarshal(&sarama.ConsumerMessage{Headers: ptrs(rec.Headers)})
		if err != nil || back.UUID != tc.msg.UUID {
			t.Errorf("round trip: UUID %q, err %v; want %q", back.UUID, err, tc.msg.UUID)
		}
	}
}

func ptrs(hs []sarama.RecordHeader) []*sarama.RecordHeader {
	out := make([]*sarama.RecordHeader, len(hs))
	for i := range hs {
		out[i] = &hs[i]
	}
	return out
}

func TestConfigValidate(t *testing.T) {
	ok := kafka.Config{Brokers: []string{"b:9092"}, ConsumerGroup: "g"}
	if err := ok.Validate(); err != nil {
		t.Fatalf("minimal config: %v", err)
	}
	keyFn := func(string, *message.Message) (string, error) { return "", nil }
	cases := map[string]func(c *kafka.Config){
		"no brokers":                  func(c *kafka.Config) { c.Brokers = nil },
		"empty broker":                func(c *kafka.Config) { c.Brokers = []string{"b:9092", " "} },
		"initial offset 5":            func(c *kafka.Config) { c.InitialOffset = 5 },
		"version 0.10.2":              func(c *kafka.Config) { c.SaramaVersion = sarama.V0_10_2_0 },
		"marshaler and partition key": func(c *kafka.Config) { c.Marshaler = wmkafka.DefaultMarshaler{}; c.PartitionKey = keyFn },
		"negative commit interval":    func(c *kafka.Config) { c.CommitInterval = -2 },
		"negative session timeout":    func(c *kafka.Config) { c.SessionTimeout = -time.Second },
		"heartbeat not below session": func(c *kafka.Config) { c.SessionTimeout = time.Second; c.HeartbeatInterval = time.Second },
		"negative nack sleep":         func(c *kafka.Config) { c.NackResendSleep = -5 },
	}
	for name, mutate := range cases {
		t.Run(name, func(t *testing.T) {
			c := ok
			mutate(&c)
			err := c.Validate()
			if !errors.Is(err, inbox.ErrInvalidConfig) {
				t.Fatalf("Validate = %v, want an error wrapping inbox.ErrInvalidConfig", err)
			}
			if _, err := kafka.NewSubscriber(c, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
				t.Errorf("NewSubscriber = %v, want inbox.ErrInvalidConfig", err)
			}
			if _, err := kafka.NewPublisher(c, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
				t.Errorf("NewPublisher = %v, want inbox.ErrInvalidConfig", err)
			}
		})
	}
	for _, c := range []kafka.Config{
		{Brokers: []string{"b:9092"}, CommitInterval: kafka.CommitEveryAck, NackResendSleep: wmkafka.NoSleep, ReconnectRetrySleep: wmkafka.NoSleep},
		{Brokers: []string{"b:9092"}, InitialOffset: sarama.OffsetNewest, SaramaVersion: sarama.V0_11_0_0},
		{Brokers: []string{"b:9092"}, SessionTimeout: 2 * time.Second}, // heartbeat defaults to a third
	} {
		if err := c.Validate(); err != nil {
			t.Errorf("%+v: %v", c, err)
		}
	}
	noGroup := kafka.Config{Brokers: []string{"b:9092"}}
	if _, err := kafka.NewSubscriber(noGroup, nil); !errors.Is(err, inbox.ErrInvalidConfig) || !strings.Contains(err.Error(), "ConsumerGroup") {
		t.Errorf("NewSubscriber without a group = %v, want an ErrInvalidConfig naming ConsumerGroup", err)
	}
}

// mustRefuse are the BrokerSideFields names inbox.MetadataKey refuses even without the
// adapter's map (its built-in list).
var mustRefuse = []string{"partition", "offset", "kafka_partition", "kafka_offset"}

// TestBrokerSideFieldsAreRefused checks that no Kafka delivery-describing name can become the
// inbox key through inbox.MetadataKey given the adapter's map, in any letter case, that the
// built-in list refuses the names it knows without the map, and that New hands the map out as
// the Broker's BrokerSideFields. Names only the map refuses are logged.
func TestBrokerSideFieldsAreRefused(t *testing.T) {
	var mapOnly []string
	for name, why := range kafka.BrokerSideFields {
		if name != strings.ToLower(name) || why == "" {
			t.Errorf("BrokerSideFields[%q] = %q: want a lower-case name and a reason", name, why)
		}
		for _, variant := range []string{name, strings.ToUpper(name), " " + name} {
			if _, err := inbox.MetadataKey(strings.TrimSpace(variant), kafka.BrokerSideFields); !errors.Is(err, inbox.ErrBrokerSideKey) {
				t.Errorf("inbox.MetadataKey(%q, kafka.BrokerSideFields) = %v, want ErrBrokerSideKey", variant, err)
			}
		}
		if !brokerside.IsDeliveryState(name, kafka.BrokerSideFields) {
			t.Errorf("brokerside.IsDeliveryState(%q, kafka.BrokerSideFields) = false", name)
		}
		_, err := inbox.MetadataKey(name)
		switch {
		case errors.Is(err, inbox.ErrBrokerSideKey):
		case slices.Contains(mustRefuse, name):
			t.Errorf("inbox.MetadataKey(%q) = %v, want ErrBrokerSideKey", name, err)
		default:
			mapOnly = append(mapOnly, name)
		}
	}
	for _, name := range mustRefuse {
		if _, ok := kafka.BrokerSideFields[name]; !ok {
			t.Errorf("BrokerSideFields lacks %q", name)
		}
	}
	slices.Sort(mapOnly)
	t.Logf("refused only with kafka.BrokerSideFields: %v", mapOnly)

	if _, err := inbox.MetadataKey("payment_request_id", kafka.BrokerSideFields); err != nil {
		t.Errorf("a business field was refused: %v", err)
	}
	if _, err := inbox.MetadataKey("", kafka.BrokerSideFields); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("empty field: %v, want ErrInvalidConfig", err)
	}

	b, err := kafka.New(kafka.Config{Brokers: []string{"127.0.0.1:1"}, ConsumerGroup: "g"}, nil)
	if err == nil {
		_ = b.Close()
		t.Fatal("New connected to a closed port")
	}
	if errors.Is(err, inbox.ErrInvalidConfig) {
		t.Fatalf("New on an unreachable broker = %v: not a configuration error", err)
	}
}

// TestNewValidates checks that New refuses what NewSubscriber and NewPublisher refuse, before
// connecting anywhere.
func TestNewValidates(t *testing.T) {
	for name, c := range map[string]kafka.Config{
		"no brokers": {ConsumerGroup: "g"},
		"no group":   {Brokers: []string{"127.0.0.1:1"}},
		"bad offset": {Brokers: []string{"127.0.0.1:1"}, ConsumerGroup: "g", InitialOffset: 3},
	} {
		if b, err := kafka.New(c, nil); !errors.Is(err, inbox.ErrInvalidConfig) {
			if b != nil {
				_ = b.Close()
			}
			t.Errorf("%s: New = %v, want inbox.ErrInvalidConfig", name, err)
		}
	}
}

func TestParseBrokers(t *testing.T) {
	for in, want := range map[string][]string{
		"127.0.0.1:9092":                              {"127.0.0.1:9092"},
		"kafka://127.0.0.1:9092,127.0.0.1:9093":       {"127.0.0.1:9092", "127.0.0.1:9093"},
		"KAFKA://k1:9092, k2:9092/":                   {"k1:9092", "k2:9092"},
		" k1:9092 ,k2:9093,[::1]:9094 ":               {"k1:9092", "k2:9093", "[::1]:9094"},
		"kafka-1.internal:9092,kafka-2.internal:9092": {"kafka-1.internal:9092", "kafka-2.internal:9092"},
	} {
		got, err := kafka.ParseBrokers(in)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("ParseBrokers(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, in := range []string{"", " ", "kafka://", "k1:9092,", "k1:9092,,k2:9092", "k1", "amqp://k1:5672", "k1:"} {
		if got, err := kafka.ParseBrokers(in); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("ParseBrokers(%q) = %q, %v; want inbox.ErrInvalidConfig", in, got, err)
		}
	}
}
