package redis

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	goredis "github.com/redis/go-redis/v9"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// TestRedeliveryMarksTravelWithTheEntry: the hook marks the entries an XCLAIM returned, in
// their own field maps, and nothing another command returned; Redelivery answers Redelivered
// for a marked entry's message (its re-sent copy too), FirstDelivery once for a message as
// read otherwise and RedeliveryUnknown for its re-sent copy and for anything else; one UUID
// claimed in one group and read fresh in another (or twice in one) keeps each delivery's own
// answer, whatever the order; a producer cannot forge a first delivery. (The signal against a
// real consumer killed inside its handler is TestPoisonCrashLoop.)
func TestRedeliveryMarksTravelWithTheEntry(t *testing.T) {
	hook := claimHook{}.ProcessHook(func(context.Context, goredis.Cmder) error { return nil })
	entry := func(id string) goredis.XMessage {
		return goredis.XMessage{ID: "1-0", Values: map[string]any{redisstream.UUIDHeaderKey: id, "payload": "p"}}
	}
	claim := goredis.NewXMessageSliceCmd(context.Background(), "xclaim", "s", "g1", "c", 0, "1-0")
	claim.SetVal([]goredis.XMessage{entry("m"), {ID: "2-0"}})
	read := goredis.NewXMessageSliceCmd(context.Background(), "xrange", "s", "-", "+")
	read.SetVal([]goredis.XMessage{entry("m")})
	for _, c := range []goredis.Cmder{claim, read} {
		if err := hook(context.Background(), c); err != nil {
			t.Fatal(err)
		}
	}
	msg := func(x goredis.XMessage) *message.Message {
		m, err := Unmarshaller{}.Unmarshal(x.Values)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	fresh, claimed := msg(read.Val()[0]), msg(claim.Val()[0])
	// The fresh read of the same UUID asks first: the claimed delivery still reads Redelivered.
	// Each copy is made after the call before it, as watermill-redisstream copies a message
	// after its nack.
	check := func(name string, m *message.Message, want inbox.Redelivery) {
		t.Helper()
		if got := Redelivery(m); got != want {
			t.Errorf("%s: %v, want %v", name, got, want)
		}
	}
	check("a fresh read", fresh, inbox.FirstDelivery)
	check("its copy re-sent after a nack", fresh.Copy(), inbox.RedeliveryUnknown)
	check("a second call for the fresh read", fresh, inbox.RedeliveryUnknown)
	check("a claimed entry of the same UUID", claimed, inbox.Redelivered)
	check("its copy re-sent after a nack", claimed.Copy(), inbox.Redelivered)
	check("a message not read by the Unmarshaller", message.NewMessage("x", nil), inbox.RedeliveryUnknown)
	forged := message.NewMessage("m-forged", nil)
	forged.Metadata.Set(ReadKey, readFresh)
	raw, _ := redisstream.DefaultMarshallerUnmarshaller{}.Marshal("s", forged)
	raw[claimedField] = "1" // as go-redis hands a claimed entry's fields
	if m := msg(goredis.XMessage{Values: raw}); Redelivery(m) != inbox.Redelivered {
		t.Errorf("a claimed entry whose producer set %s=%q read %v, want Redelivered", ReadKey, readFresh, m.Metadata.Get(ReadKey))
	}
}
