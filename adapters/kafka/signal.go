package kafka

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wmkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// The first-delivery signal (docs/adapters.md, "Redelivery signal"; docs/design.md, "The worst
// case").
//
// A record is a first delivery to the consumer group when no consumer of the group can have
// fetched it before. Kafka lets a consumer fetch only records below the partition's high
// watermark, and a consumer-group member is assigned a partition only after its previous
// owner stopped consuming it (eager rebalancing: the owner rejoins only once its claims have
// returned; cooperative: a revoked claim is finished before the follow-up join) or was removed
// from the group. So when a member reads the high watermark X after its session started, every
// record another member fetched before is below X, and a record at or above X can have been
// fetched before only by this very claim, or by a member the coordinator removed that still
// fetches (a zombie: paused, or cut off from the coordinator).
//
// The pieces:
//   - signalHandler (sarama's ConsumerGroupHandler, installed through watermill-kafka's Tracer
//     hook) reads X per partition in Setup, once the session holds its assignment, and again
//     in ConsumeClaim for a partition Setup did not cover; it forwards each record of the claim
//     and marks the records at or above X (each offset once per claim) as eligible.
//   - signalUnmarshaler turns an eligible record into a registered *message.Message: only that
//     object, the one watermill-kafka sends to the router first, can read FirstDelivery. A
//     nacked record is re-sent as a copy (message.Message.Copy), which is not registered, and
//     Redelivery forgets a message once read, so a second handler run in process (a Retry
//     middleware) is not a first delivery either.
//   - the session's lease closes the zombie gap: the adapter heartbeats the coordinator itself
//     with the session's member ID and generation. After a heartbeat that succeeded, sent at t,
//     the coordinator cannot complete a rebalance that drops this member before
//     t + min(session timeout, rebalance timeout) (it waits for the member to rejoin, or for its
//     session to expire). FirstDelivery is given only while t + half of that has not passed,
//     so a member that is no longer the partition's owner never reads FirstDelivery for a record
//     its successor can read FirstDelivery for.
//
// Off (always RedeliveryUnknown): static membership (Consumer.Group.InstanceId lets a new
// instance take a member's partitions without a rebalance), and sarama protocol versions
// before 2.2.0, whose ListOffsets may answer with a new leader's stale high watermark (KIP-207).

// MinSignalVersion is the oldest Kafka protocol version for which the adapter gives a
// first-delivery signal: 2.2.0, where ListOffsets stopped returning a lagging high watermark
// after a leader change (KIP-207, OFFSET_NOT_AVAILABLE). With an older Config.SaramaVersion
// Redelivery always returns inbox.RedeliveryUnknown.
var MinSignalVersion = sarama.V2_2_0_0

// Redelivery is the Kafka adapter's redelivery signal (adapters.Broker.Redelivery of New's
// Broker): inbox.FirstDelivery for a message a subscriber of this package hands to the router
// for the first time when its record was appended to the partition after the consuming
// session was assigned it (its offset is at or above the high watermark read then) and the
// session's lease on its membership is current; inbox.RedeliveryUnknown otherwise: records
// that were in the log when the partition was assigned (a backlog, a redelivery after a crash
// or rebalance), a nacked record's re-send, a second call for the same message, messages of
// any other subscriber, static membership, SaramaVersion before MinSignalVersion. It never
// returns inbox.Redelivered: Kafka keeps no delivery count. Each message reads FirstDelivery
// at most once: the inbox calls it once per delivery.
func Redelivery(msg *message.Message) inbox.Redelivery {
	if msg == nil {
		return inbox.RedeliveryUnknown
	}
	v, ok := firstHandoffs.LoadAndDelete(weak.Make(msg))
	if !ok {
		return inbox.RedeliveryUnknown
	}
	if v.(*signalSession).leaseValid(time.Now()) {
		return inbox.FirstDelivery
	}
	return inbox.RedeliveryUnknown
}

var (
	// eligibleRecords: records at or above their claim's high watermark, forwarded to
	// watermill-kafka and not yet unmarshaled (*sarama.ConsumerMessage -> *signalSession).
	eligibleRecords sync.Map
	// firstHandoffs: messages unmarshaled from eligible records, not yet read by Redelivery
	// (weak.Pointer[message.Message] -> *signalSession). An entry goes when Redelivery reads it
	// or when its message is garbage collected.
	firstHandoffs sync.Map
)

func forgetHandoff(key weak.Pointer[message.Message]) { firstHandoffs.Delete(key) }

// signalUnmarshaler registers the message of an eligible record (see Redelivery).
type signalUnmarshaler struct{ inner wmkafka.Unmarshaler }

func (u signalUnmarshaler) Unmarshal(rec *sarama.ConsumerMessage) (*message.Message, error) {
	v, eligible := eligibleRecords.LoadAndDelete(rec)
	msg, err := u.inner.Unmarshal(rec)
	if err != nil || !eligible || msg == nil {
		return msg, err
	}
	key := weak.Make(msg)
	firstHandoffs.Store(key, v)
	runtime.AddCleanup(msg, forgetHandoff, key)
	return msg, nil
}

// signalTracer is watermill-kafka's Tracer hook, used only to wrap the consumer-group handler.
type signalTracer struct {
	brokers []string
	group   string
	sarama  *sarama.Config // the subscriber's own (OverwriteSaramaConfig), read at each Setup
	logger  watermill.LoggerAdapter
}

func (t *signalTracer) WrapConsumer(c sarama.Consumer) sarama.Consumer { return c }
func (t *signalTracer) WrapPartitionConsumer(pc sarama.PartitionConsumer) sarama.PartitionConsumer {
	return pc
}
func (t *signalTracer) WrapSyncProducer(_ *sarama.Config, p sarama.SyncProducer) sarama.SyncProducer {
	return p
}
func (t *signalTracer) WrapConsumerGroupHandler(h sarama.ConsumerGroupHandler) sarama.ConsumerGroupHandler {
	return &signalHandler{inner: h, t: t}
}

// signalEnabled says whether sc allows a sound signal, and why not.
func signalEnabled(sc *sarama.Config) (bool, string) {
	switch {
	case sc == nil:
		return false, "no sarama configuration"
	case sc.Consumer.Group.InstanceId != "":
		return false, "static membership (Consumer.Group.InstanceId)"
	case !sc.Version.IsAtLeast(MinSignalVersion):
		return false, fmt.Sprintf("sarama version %s before %s", sc.Version, MinSignalVersion)
	}
	return true, ""
}

// signalHandler wraps watermill-kafka's consumer-group handler. One sarama consumer group runs
// its sessions one after another, so one session is current at a time.
type signalHandler struct {
	inner sarama.ConsumerGroupHandler
	t     *signalTracer
	cur   atomic.Pointer[signalSession]
}

func (h *signalHandler) Setup(sess sarama.ConsumerGroupSession) error {
	if s := h.cur.Swap(nil); s != nil {
		s.stop()
	}
	if ok, why := signalEnabled(h.t.sarama); !ok {
		h.t.logger.Debug("Kafka first-delivery signal off", watermill.LogFields{"reason": why})
	} else if s, err := startSignalSession(h.t, sess); err != nil {
		// Without the session's high watermarks or lease every record reads RedeliveryUnknown,
		// which costs only the inbox's count before the handler.
		h.t.logger.Info("Kafka first-delivery signal off for this session", watermill.LogFields{"err": redact.Err(err, h.t.brokers...).Error()})
	} else {
		h.cur.Store(s)
	}
	return h.inner.Setup(sess)
}

func (h *signalHandler) Cleanup(sess sarama.ConsumerGroupSession) error {
	err := h.inner.Cleanup(sess)
	if s := h.cur.Swap(nil); s != nil {
		s.stop()
	}
	return err
}

func (h *signalHandler) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	s := h.cur.Load()
	if s == nil || s.sess != sess {
		return h.inner.ConsumeClaim(sess, claim)
	}
	x, ok := s.highWatermark(claim.Topic(), claim.Partition())
	if !ok {
		return h.inner.ConsumeClaim(sess, claim)
	}
	fc := &forwardingClaim{ConsumerGroupClaim: claim, out: make(chan *sarama.ConsumerMessage)}
	done := make(chan struct{})
	forwarded := make(chan struct{})
	go func() {
		defer close(forwarded)
		defer close(fc.out)
		next := x // the lowest offset that may still be a first delivery in this claim
		records := claim.Messages()
		for {
			// Waiting for a record watches done too: watermill-kafka's handler can return
			// while the claim lives on (an unmarshal error), and sarama closes the claim's
			// channel only after ConsumeClaim returned.
			var rec *sarama.ConsumerMessage
			select {
			case r, ok := <-records:
				if !ok {
					return
				}
				rec = r
			case <-done:
				return
			}
			eligible := rec.Offset >= next
			if eligible {
				next = rec.Offset + 1
				eligibleRecords.Store(rec, s)
			}
			select {
			case fc.out <- rec:
			case <-done:
				if eligible {
					eligibleRecords.Delete(rec)
				}
				return
			}
		}
	}()
	err := h.inner.ConsumeClaim(sess, fc)
	close(done)
	<-forwarded
	return err
}

// forwardingClaim is a claim whose records pass through signalHandler's forwarder.
type forwardingClaim struct {
	sarama.ConsumerGroupClaim
	out chan *sarama.ConsumerMessage
}

func (c *forwardingClaim) Messages() <-chan *sarama.ConsumerMessage { return c.out }

type topicPartition struct {
	topic     string
	partition int32
}

// signalSession is the signal's state for one sarama consumer-group session: its own client
// (high watermarks, heartbeats), the high watermarks read in Setup, and the lease.
type signalSession struct {
	sess    sarama.ConsumerGroupSession
	group   string
	client  sarama.Client
	version sarama.KafkaVersion
	// lease: how long after a successful heartbeat's sending FirstDelivery may be given;
	// interval: the pause between heartbeats.
	lease, interval time.Duration
	mu              sync.Mutex
	// hw: high watermarks read in Setup, each taken by the first claim of its partition (a
	// partition revoked and given back within one cooperative session reads its own).
	hw map[topicPartition]int64
	// validUntil: the lease's end, with Go's monotonic clock reading; zero: no lease.
	validUntil time.Time

	quit    chan struct{}
	stopped sync.Once
	beats   sync.WaitGroup
}

var errHeartbeat = errors.New("kafka: first-delivery lease: heartbeat refused")

func startSignalSession(t *signalTracer, sess sarama.ConsumerGroupSession) (*signalSession, error) {
	sc := t.sarama
	client, err := sarama.NewClient(t.brokers, sc)
	if err != nil {
		return nil, fmt.Errorf("kafka: first-delivery signal client: %w", err)
	}
	lease := min(sc.Consumer.Group.Session.Timeout, sc.Consumer.Group.Rebalance.Timeout) / 2
	s := &signalSession{
		sess: sess, group: t.group, client: client, version: sc.Version,
		lease: lease, interval: lease / 3,
		hw:   map[topicPartition]int64{},
		quit: make(chan struct{}),
	}
	if err := s.heartbeat(); err != nil {
		_ = client.Close()
		return nil, err
	}
	for topic, partitions := range sess.Claims() {
		for _, p := range partitions {
			if off, err := client.GetOffset(topic, p, sarama.OffsetNewest); err == nil && off >= 0 {
				s.hw[topicPartition{topic, p}] = off
			}
		}
	}
	s.beats.Add(1)
	go s.heartbeatLoop()
	return s, nil
}

// highWatermark returns the partition's high watermark read in Setup, or reads it now (a claim
// added by a cooperative rebalance; a failed read in Setup). Read after the session began,
// either is at least every offset a previous owner fetched.
func (s *signalSession) highWatermark(topic string, partition int32) (int64, bool) {
	tp := topicPartition{topic, partition}
	s.mu.Lock()
	off, ok := s.hw[tp]
	delete(s.hw, tp)
	s.mu.Unlock()
	if ok {
		return off, true
	}
	off, err := s.client.GetOffset(topic, partition, sarama.OffsetNewest)
	return off, err == nil && off >= 0
}

// heartbeat sends one heartbeat for the session's member and generation and extends the lease
// when the coordinator accepts it.
func (s *signalSession) heartbeat() error {
	coordinator, err := s.client.Coordinator(s.group)
	if err != nil {
		return fmt.Errorf("kafka: first-delivery lease: coordinator: %w", err)
	}
	req := &sarama.HeartbeatRequest{GroupId: s.group, MemberId: s.sess.MemberID(), GenerationId: s.sess.GenerationID()}
	// The versions sarama's own heartbeat uses (consumerGroup.heartbeatRequest); no
	// GroupInstanceId: the signal is off with static membership.
	switch {
	case s.version.IsAtLeast(sarama.V2_4_0_0):
		req.Version = 4
	case s.version.IsAtLeast(sarama.V2_3_0_0):
		req.Version = 3
	case s.version.IsAtLeast(sarama.V2_0_0_0):
		req.Version = 2
	case s.version.IsAtLeast(sarama.V0_11_0_0):
		req.Version = 1
	}
	sent := time.Now()
	resp, err := coordinator.Heartbeat(req)
	if err != nil {
		_ = s.client.RefreshCoordinator(s.group)
		return fmt.Errorf("kafka: first-delivery lease: %w", err)
	}
	if !errors.Is(resp.Err, sarama.ErrNoError) {
		if errors.Is(resp.Err, sarama.ErrNotCoordinatorForConsumer) || errors.Is(resp.Err, sarama.ErrConsumerCoordinatorNotAvailable) {
			_ = s.client.RefreshCoordinator(s.group)
		}
		return fmt.Errorf("%w: %w", errHeartbeat, resp.Err)
	}
	s.mu.Lock()
	if until := sent.Add(s.lease); until.After(s.validUntil) {
		s.validUntil = until
	}
	s.mu.Unlock()
	return nil
}

func (s *signalSession) heartbeatLoop() {
	defer s.beats.Done()
	tick := time.NewTicker(s.interval)
	defer tick.Stop()
	for {
		select {
		case <-s.quit:
			return
		case <-s.sess.Context().Done():
			// The session is over (a rebalance began, or the member left): no renewal.
			return
		case <-tick.C:
			_ = s.heartbeat() // a refused or failed heartbeat only lets the lease run out
		}
	}
}

// leaseValid says whether FirstDelivery may be given at now. Both times carry Go's monotonic
// clock reading, so the comparison measures elapsed time since the heartbeat was sent.
func (s *signalSession) leaseValid(now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return now.Before(s.validUntil)
}

// stop ends the heartbeats, ends the lease and closes the client.
func (s *signalSession) stop() {
	s.stopped.Do(func() {
		close(s.quit)
		s.beats.Wait()
		s.mu.Lock()
		s.validUntil = time.Time{}
		s.mu.Unlock()
		_ = s.client.Close()
	})
}
