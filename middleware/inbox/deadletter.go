package inbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/watermill-inbox/watermill-inbox/internal/brokerside"
)

// deadLetter publishes a copy of the received message to the dead-letter topic with
// d.res.Reason, and records the dead-lettered state when mark is set (not for a collision or
// an invalid key: the key is not this message's). It returns nil (ack), or the publish error
// (nack): a message is never acked without its dead letter.
func (i *Inbox) deadLetter(d *delivery, mark bool) error {
	ctx := d.ctx
	dl := d.msg.Copy()
	for k := range dl.Metadata {
		// Delivery-specific fields (a redelivered flag, a delivery count) would describe the
		// original delivery, and make a replayed message look redelivered.
		if brokerside.IsDeliveryState(k, i.cfg.BrokerSideFields) {
			delete(dl.Metadata, k)
		}
	}
	dl.Metadata.Set(wmmiddleware.ReasonForPoisonedKey, d.res.Reason)
	dl.Metadata.Set(wmmiddleware.PoisonedTopicKey, message.SubscribeTopicFromCtx(ctx))
	dl.Metadata.Set(wmmiddleware.PoisonedHandlerKey, message.HandlerNameFromCtx(ctx))
	dl.Metadata.Set(wmmiddleware.PoisonedSubscriberKey, message.SubscriberNameFromCtx(ctx))
	dl.Metadata.Set(DeadLetterAttemptsKey, strconv.Itoa(d.res.Attempts))
	dl.Metadata.Set(DeadLetterConsumerKey, i.cfg.ConsumerName)
	dl.Metadata.Set(DeadLetterMessageKeyKey, d.claim.Key.MessageID)
	fields := watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID), "attempts": d.res.Attempts, "dead_letter_topic": i.cfg.DeadLetterTopic}
	pctx, endPhase := i.startPhase(ctx, PhaseDeadLetter)
	i.inject(pctx, PhaseDeadLetter, dl)
	if err := i.cfg.DeadLetterPublisher.Publish(i.cfg.DeadLetterTopic, dl); err != nil {
		endPhase(err)
		i.logger.Error("Could not publish the dead letter; nacking", err, fields)
		return fmt.Errorf("inbox: publishing dead letter: %w", err)
	}
	defer endPhase(nil)
	if mark {
		mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), i.cfg.FinishTimeout)
		defer cancel()
		if err := d.store.MarkDeadLettered(mctx, d.claim.Key, d.res.Reason); err != nil {
			// The dead letter is out, so ack anyway: the attempt count stays at the limit,
			// so a later delivery is dead-lettered again rather than processed.
			i.logger.Error("Dead letter published but its state not recorded", err, fields)
		}
	}
	// ERROR: a dead letter needs an operator (Watermill's LoggerAdapter has no WARN level).
	i.logger.Error("Message dead-lettered", errors.New(d.res.Reason), fields)
	return nil
}

// exhaustedReason is the dead-letter reason of a message whose earlier deliveries used up
// maxAttempts before this one could run its handler.
func exhaustedReason(earlier, maxAttempts int, lastError string) string {
	if lastError != "" {
		return fmt.Sprintf("failed %d of %d attempts; last error: %s", earlier, maxAttempts, lastError)
	}
	return fmt.Sprintf("%d of %d attempts ran the handler and ended without settling, recording no error: "+
		"the consumer process died or lost its database connection while the handler ran", earlier, maxAttempts)
}

// Replay clears the dead-lettered state and attempt count of messageID (the message's key:
// its UUID with the default key extractor, otherwise the business key, which a dead letter
// carries in DeadLetterMessageKeyKey) for this consumer, so its next delivery runs the
// handler again; republish the dead letter to the handler's topic after it. It reports
// whether the message was dead-lettered, or an *InvalidKeyError for an invalid messageID.
//
// With Config.Stores, which do not say where messageID was routed, it replays on every store
// (the key is dead-lettered on its route's database only) and reports whether any store had it
// dead-lettered; the errors of the stores that failed are joined. ReplayDeadLetter replays on
// the dead letter's own route.
func (i *Inbox) Replay(ctx context.Context, messageID string) (bool, error) {
	if err := ValidateKey("message ID", messageID); err != nil {
		return false, err
	}
	k := Key{MessageID: messageID, ConsumerName: i.cfg.ConsumerName}
	var replayed bool
	var errs []error
	for _, s := range i.cfg.stores() {
		ok, err := s.Replay(ctx, k)
		replayed = replayed || ok
		errs = append(errs, err)
	}
	return replayed, errors.Join(errs...)
}

// deadLetterKeys are the metadata keys a dead letter carries that ReplayDeadLetter removes
// before republishing: Watermill's PoisonQueue keys and the inbox's own.
var deadLetterKeys = []string{
	wmmiddleware.ReasonForPoisonedKey, wmmiddleware.PoisonedTopicKey, wmmiddleware.PoisonedHandlerKey,
	wmmiddleware.PoisonedSubscriberKey, DeadLetterAttemptsKey, DeadLetterConsumerKey, DeadLetterMessageKeyKey,
}

// ReplayDeadLetter replays dl, a message read from this inbox's dead-letter topic: it clears
// the dead-lettered state of the key the dead letter names (metadata DeadLetterMessageKeyKey,
// which is the business key when the inbox uses MetadataKey, so replaying by msg.UUID is never
// needed), then publishes a copy with pub to the topic the message was consumed from
// (metadata topic_poisoned), with the same UUID and payload and without the dead-letter
// metadata, so the next delivery runs the handler again. If the publish fails, the
// dead-lettered state is restored (best effort) and the error returned; the call can be
// repeated.
//
// With Config.Stores the key is replayed on the store Config.Route names for dl (the dead
// letter keeps the message's metadata).
//
// Errors: ErrInvalidConfig (wrapped) when dl names another consumer (DeadLetterConsumerKey),
// has no topic_poisoned; an *InvalidKeyError when dl
// names no valid key (an invalid key's dead letter cannot be replayed); a *RouteError when
// Config.Route names no store for dl; ErrNotDeadLettered
// when the key is not dead-lettered; the publisher's error.
func (i *Inbox) ReplayDeadLetter(ctx context.Context, dl *message.Message, pub message.Publisher) error {
	if c := dl.Metadata.Get(DeadLetterConsumerKey); c != i.cfg.ConsumerName {
		return fmt.Errorf("%w: dead letter %s belongs to consumer %q, not %q", ErrInvalidConfig, safeUUID(dl.UUID), c, i.cfg.ConsumerName)
	}
	topic := dl.Metadata.Get(wmmiddleware.PoisonedTopicKey)
	if topic == "" {
		return fmt.Errorf("%w: dead letter %s has no %s metadata", ErrInvalidConfig, safeUUID(dl.UUID), wmmiddleware.PoisonedTopicKey)
	}
	key := dl.Metadata.Get(DeadLetterMessageKeyKey)
	if err := ValidateKey("message ID", key); err != nil {
		return err
	}
	store, _, err := i.storeFor(dl) // the dead letter carries the message's metadata, and so its route
	if err != nil {
		return err
	}
	replayed, err := store.Replay(ctx, Key{MessageID: key, ConsumerName: i.cfg.ConsumerName})
	if err != nil {
		return err
	}
	if !replayed {
		return fmt.Errorf("%w: key of dead letter %s", ErrNotDeadLettered, safeUUID(dl.UUID))
	}
	m := message.NewMessage(dl.UUID, dl.Payload)
	for k, v := range dl.Metadata {
		m.Metadata.Set(k, v)
	}
	for _, k := range deadLetterKeys {
		delete(m.Metadata, k)
	}
	m.Metadata.Set(DeadLetterReplayedKey, "true") // the TooOldGuard lets an operator's replay through
	if err := pub.Publish(topic, m); err != nil {
		if merr := store.MarkDeadLettered(context.WithoutCancel(ctx), Key{MessageID: key, ConsumerName: i.cfg.ConsumerName},
			dl.Metadata.Get(wmmiddleware.ReasonForPoisonedKey)); merr != nil {
			return fmt.Errorf("inbox: republishing dead letter %s: %w (and restoring its dead-lettered state: %w)", safeUUID(dl.UUID), err, merr)
		}
		return fmt.Errorf("inbox: republishing dead letter %s: %w", safeUUID(dl.UUID), err)
	}
	return nil
}
