package inbox

import (
	"context"
	"fmt"
	"strconv"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
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
		if IsBrokerSideField(k, i.cfg.BrokerSideFields) {
			delete(dl.Metadata, k)
		}
	}
	dl.Metadata.Set(wmmiddleware.ReasonForPoisonedKey, d.res.Reason)
	dl.Metadata.Set(wmmiddleware.PoisonedTopicKey, message.SubscribeTopicFromCtx(ctx))
	dl.Metadata.Set(wmmiddleware.PoisonedHandlerKey, message.HandlerNameFromCtx(ctx))
	dl.Metadata.Set(wmmiddleware.PoisonedSubscriberKey, message.SubscriberNameFromCtx(ctx))
	dl.Metadata.Set(DeadLetterAttemptsKey, strconv.Itoa(d.res.Attempts))
	dl.Metadata.Set(DeadLetterConsumerKey, i.cfg.ConsumerName)
	dl.Metadata.Set(DeadLetterMessageKeyKey, d.params.Key.MessageID)
	fields := watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID), "attempts": d.res.Attempts, "dead_letter_topic": i.cfg.DeadLetterTopic}
	if err := i.cfg.DeadLetterPublisher.Publish(i.cfg.DeadLetterTopic, dl); err != nil {
		i.logger.Error("Could not publish the dead letter; nacking", err, fields)
		return fmt.Errorf("inbox: publishing dead letter: %w", err)
	}
	if mark {
		mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), i.cfg.FinishTimeout)
		defer cancel()
		if err := i.attempts.MarkDeadLettered(mctx, AttemptParams{Key: d.params.Key, Error: d.res.Reason}); err != nil {
			// The dead letter is out, so ack anyway: the attempt count stays at the limit,
			// so a later delivery is dead-lettered again rather than processed.
			i.logger.Error("Dead letter published but its state not recorded", err, fields)
		}
	}
	i.logger.Info("Message dead-lettered", fields.Add(watermill.LogFields{"reason": d.res.Reason}))
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
// whether the message was dead-lettered; an *InvalidKeyError for an invalid messageID, and an
// error wrapping ErrInvalidConfig when the Store is not an AttemptStore.
func (i *Inbox) Replay(ctx context.Context, messageID string) (bool, error) {
	if err := ValidateKey("message ID", messageID); err != nil {
		return false, err
	}
	as, ok := i.cfg.Store.(AttemptStore)
	if !ok {
		return false, fmt.Errorf("%w: Replay needs a Store that implements AttemptStore; %T does not", ErrInvalidConfig, i.cfg.Store)
	}
	return as.Replay(ctx, AttemptParams{Key: Key{MessageID: messageID, ConsumerName: i.cfg.ConsumerName}})
}
