package redis

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
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
// A nacked message is not returned to Redis: the subscription hands the same message to the
// router again, in process. So every delivery that may follow an earlier run of the handler
// in another process came through XCLAIM.
//
// The subscriber's client carries a go-redis hook (claimHook) that reads the UUID of every
// entry an XCLAIM returned, before the subscription hands it on, into a set shared by the
// broker's subscriptions (claimedSet). Redelivery answers inbox.Redelivered for a UUID in the
// set (taking it out), inbox.FirstDelivery for a message as read by XREADGROUP (marked by
// Unmarshaller under ReadKey, once), and inbox.RedeliveryUnknown for the copy re-sent in process
// after a nack, so the inbox counts durably, before the handler, only the deliveries that may
// be redeliveries, and counts a first delivery only when it fails (design.md, "Attempt
// accounting").
//
// What it is worth: a consumer killed inside a handler leaves the entry pending, and its next
// delivery, in any process of the group, is an XCLAIM, counted before the handler runs, so a
// message that kills its consumer every time is dead-lettered after MaxAttempts runs. A UUID
// published twice is two entries, each a first delivery: the inbox's claim and attempt record
// are by UUID and treat the second as a duplicate or a dead-lettered key. A set shared by
// several consumer groups in one process can only err towards Redelivered (a UUID claimed in
// one group and read fresh in another), which costs the count, never a missed one. Entries
// claimed but never handed to the inbox (the subscription closed first) leave their UUID in
// the set for claimedTTL at most.

// ReadKey is the metadata field Unmarshaller sets on every message it reads from Redis
// ("1"); the broker's Redelivery changes it to "0" on the message it answers FirstDelivery for,
// so the copy watermill-redisstream hands the router again after a nack (msg.Copy(), which
// copies the metadata) reads RedeliveryUnknown. A broker-side field (BrokerSideFields): never
// an idempotency key, removed from dead letters.
const ReadKey = "_watermill_inbox_redis_read"

const (
	readFresh = "1" // as read from Redis
	readSeen  = "0" // answered FirstDelivery once
)

// claimedTTL bounds how long a claimed entry's UUID stays in the set when no delivery takes it
// out.
const claimedTTL = 10 * time.Minute

// claimedSet holds the UUIDs of entries this process took over with XCLAIM, with when.
type claimedSet struct {
	mu   sync.Mutex
	ids  map[string]time.Time
	next time.Time // the next prune of expired entries
}

func newClaimedSet() *claimedSet { return &claimedSet{ids: map[string]time.Time{}} }

// add records the UUIDs (empty ones, of entries without a UUID, are skipped).
func (c *claimedSet) add(now time.Time, ids ...string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if now.After(c.next) {
		for id, at := range c.ids {
			if now.Sub(at) > claimedTTL {
				delete(c.ids, id)
			}
		}
		c.next = now.Add(claimedTTL / 10)
	}
	for _, id := range ids {
		if id != "" {
			c.ids[id] = now
		}
	}
}

// redelivery is the broker's inbox.RedeliveryFunc: Redelivered when msg's UUID came through
// XCLAIM (and not yet through this function); FirstDelivery for a message as Unmarshaller read
// it (ReadKey "1"), which it marks as answered; RedeliveryUnknown for anything else (a re-send
// after a nack, a second call for one delivery, a message not read by this adapter's
// Unmarshaller).
func (c *claimedSet) redelivery(msg *message.Message) inbox.Redelivery {
	c.mu.Lock()
	_, claimed := c.ids[msg.UUID]
	if claimed {
		delete(c.ids, msg.UUID)
	}
	c.mu.Unlock()
	switch {
	case claimed:
		return inbox.Redelivered
	case msg.Metadata.Get(ReadKey) == readFresh:
		msg.Metadata.Set(ReadKey, readSeen)
		return inbox.FirstDelivery
	}
	return inbox.RedeliveryUnknown
}

// claimHook is a go-redis hook recording the UUIDs of the entries each XCLAIM returns.
type claimHook struct{ set *claimedSet }

func (claimHook) DialHook(next goredis.DialHook) goredis.DialHook { return next }

func (h claimHook) ProcessHook(next goredis.ProcessHook) goredis.ProcessHook {
	return func(ctx context.Context, cmd goredis.Cmder) error {
		err := next(ctx, cmd)
		if c, ok := cmd.(*goredis.XMessageSliceCmd); ok && strings.EqualFold(cmd.Name(), "xclaim") {
			var ids []string
			for _, m := range c.Val() {
				ids = append(ids, str(m.Values[redisstream.UUIDHeaderKey]))
			}
			h.set.add(time.Now(), ids...)
		}
		return err
	}
}

func (claimHook) ProcessPipelineHook(next goredis.ProcessPipelineHook) goredis.ProcessPipelineHook {
	return next
}
