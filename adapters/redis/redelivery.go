package redis

import (
	"context"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"
	goredis "github.com/redis/go-redis/v9"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// The adapter's redelivery signal (Broker.Redelivery; the inbox's Config.Redelivery).
//
// watermill-redisstream v1.4 hands a subscription entries in two ways only: new entries, read
// with XREADGROUP and the ID ">", which Redis gives to one consumer of the group once, never
// before delivered in that group; and entries another consumer left pending for MaxIdleTime (a
// consumer that crashed, was killed or was stopped before it acked), taken over with XCLAIM.
// A nacked message is not returned to Redis: the subscription hands a copy of the same message
// (msg.Copy()) to the router again, in process. So every delivery that may follow an earlier
// run of the handler in another process came through XCLAIM.
//
// The subscriber's client carries a go-redis hook (claimHook) that marks every entry an XCLAIM
// returned, in the entry's own field map (claimedField), before the subscription hands it on:
// go-redis returns the map the subscription then gives the Unmarshaller. The Unmarshaller sets
// ReadKey on every message: readClaimed for a marked entry, readFresh for any other. Redelivery
// answers inbox.Redelivered for readClaimed, inbox.FirstDelivery once for readFresh (it then
// sets readSeen, which the copy re-sent after a nack inherits), and inbox.RedeliveryUnknown
// otherwise, so the inbox counts durably, before the handler, only the deliveries that may be
// redeliveries, and counts a first delivery only when it fails (design.md, "Attempt
// accounting").
//
// What it is worth: a consumer killed inside a handler leaves the entry pending, and its next
// delivery, in any process of the group, is an XCLAIM, counted before the handler runs, so a
// message that kills its consumer every time is dead-lettered after at most MaxAttempts + 1
// runs (the first read is not counted up front). The mark travels with the delivery, so
// several groups, topics or copies of one UUID in one process do not share it. A UUID
// published twice is two entries, each a first delivery: the inbox's claim and attempt record
// are by UUID and treat the second as a duplicate or a dead-lettered key. An entry whose
// fields carry claimedField from its producer reads Redelivered: it costs the count, never a
// missed one.

// ReadKey is the metadata field the Unmarshaller sets on every message it reads from Redis:
// readClaimed ("claimed") for an entry taken over with XCLAIM, readFresh ("1") otherwise. The
// broker's Redelivery changes readFresh to readSeen ("0") on the message it answers
// FirstDelivery for, so the copy watermill-redisstream hands the router again after a nack
// reads RedeliveryUnknown. A producer's value under this name is replaced. A broker-side field
// (BrokerSideFields): never an idempotency key, removed from dead letters.
const ReadKey = "_watermill_inbox_redis_read"

const (
	readFresh   = "1"       // read with XREADGROUP
	readSeen    = "0"       // answered FirstDelivery once
	readClaimed = "claimed" // taken over with XCLAIM
)

// claimedField is the field claimHook adds to the field map of every entry an XCLAIM returned
// (in memory only; nothing is written to Redis).
const claimedField = "_watermill_inbox_claimed"

// Redelivery is the broker's inbox.RedeliveryFunc (see ReadKey): Redelivered for an entry taken
// over with XCLAIM; FirstDelivery for a message as the Unmarshaller read it with XREADGROUP,
// which it marks as answered; RedeliveryUnknown for anything else (a re-send after a nack, a
// second call for one delivery, a message this adapter's Unmarshaller did not read).
func Redelivery(msg *message.Message) inbox.Redelivery {
	switch msg.Metadata.Get(ReadKey) {
	case readClaimed:
		return inbox.Redelivered
	case readFresh:
		msg.Metadata.Set(ReadKey, readSeen)
		return inbox.FirstDelivery
	}
	return inbox.RedeliveryUnknown
}

// claimHook is a go-redis hook marking the entries each XCLAIM returns (claimedField).
type claimHook struct{}

func (claimHook) DialHook(next goredis.DialHook) goredis.DialHook { return next }

func (claimHook) ProcessHook(next goredis.ProcessHook) goredis.ProcessHook {
	return func(ctx context.Context, cmd goredis.Cmder) error {
		err := next(ctx, cmd)
		if c, ok := cmd.(*goredis.XMessageSliceCmd); ok && strings.EqualFold(cmd.Name(), "xclaim") {
			for _, m := range c.Val() {
				if m.Values != nil {
					m.Values[claimedField] = "1"
				}
			}
		}
		return err
	}
}

func (claimHook) ProcessPipelineHook(next goredis.ProcessPipelineHook) goredis.ProcessPipelineHook {
	return next
}
