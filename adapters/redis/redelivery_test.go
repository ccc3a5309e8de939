package redis

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	goredis "github.com/redis/go-redis/v9"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// TestClaimHookMarksOnlyXClaim: the hook records the UUIDs an XCLAIM returned, and nothing
// from other reads; Redelivery answers Redelivered once per claimed UUID, FirstDelivery once
// for a message as the Unmarshaller read it, RedeliveryUnknown for its re-sent copy and for
// anything else; a producer cannot forge the mark; entries left in the set expire after
// claimedTTL. (The signal against a real
// consumer killed inside its handler is TestPoisonCrashLoop.)
func TestClaimHookMarksOnlyXClaim(t *testing.T) {
	set := newClaimedSet()
	hook := claimHook{set}.ProcessHook(func(context.Context, goredis.Cmder) error { return nil })
	claim := goredis.NewXMessageSliceCmd(context.Background(), "xclaim", "s", "g", "c", 0, "1-0")
	claim.SetVal([]goredis.XMessage{{ID: "1-0", Values: map[string]any{redisstream.UUIDHeaderKey: "m-claimed"}}, {ID: "2-0", Values: map[string]any{}}})
	rng := goredis.NewXMessageSliceCmd(context.Background(), "xrange", "s", "-", "+")
	rng.SetVal([]goredis.XMessage{{ID: "3-0", Values: map[string]any{redisstream.UUIDHeaderKey: "m-read"}}})
	for _, c := range []goredis.Cmder{claim, rng} {
		if err := hook(context.Background(), c); err != nil {
			t.Fatal(err)
		}
	}
	read := func(id string) *message.Message {
		m, err := Unmarshaller{}.Unmarshal(map[string]any{redisstream.UUIDHeaderKey: id, "payload": "p"})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	if got := set.redelivery(read("m-claimed")); got != inbox.Redelivered {
		t.Errorf("a claimed message: %v, want Redelivered", got)
	}
	first := read("m-read")
	if got := set.redelivery(first); got != inbox.FirstDelivery {
		t.Errorf("a message as read: %v, want FirstDelivery", got)
	}
	// watermill-redisstream re-sends msg.Copy() after a nack.
	if got := set.redelivery(first.Copy()); got != inbox.RedeliveryUnknown {
		t.Errorf("the copy re-sent after a nack: %v, want RedeliveryUnknown", got)
	}
	if got := set.redelivery(first); got != inbox.RedeliveryUnknown {
		t.Errorf("a second call for one delivery: %v, want RedeliveryUnknown", got)
	}
	if got := set.redelivery(message.NewMessage("m-other", nil)); got != inbox.RedeliveryUnknown {
		t.Errorf("a message not read by the Unmarshaller: %v, want RedeliveryUnknown", got)
	}
	forged := message.NewMessage("m-forged", nil)
	forged.Metadata.Set(ReadKey, readSeen)
	raw, _ := redisstream.DefaultMarshallerUnmarshaller{}.Marshal("s", forged)
	if m, _ := (Unmarshaller{}).Unmarshal(raw); m.Metadata.Get(ReadKey) != readFresh {
		t.Errorf("a producer's %s survived the read: %q", ReadKey, m.Metadata.Get(ReadKey))
	}
	old := time.Now().Add(-2 * claimedTTL)
	set.add(old, "m-old")
	set.next = time.Time{}
	set.add(time.Now(), "m-new")
	if _, ok := set.ids["m-old"]; ok {
		t.Error("an entry older than claimedTTL was kept")
	}
	if got := set.redelivery(read("m-new")); got != inbox.Redelivered {
		t.Errorf("redelivery(m-new) = %v, want Redelivered", got)
	}
}
