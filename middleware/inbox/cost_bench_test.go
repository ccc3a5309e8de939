package inbox_test

import (
	"context"
	"errors"
	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// nopStore is a store that does no I/O and allocates nothing per call: every key is claimed,
// nothing is recorded. It isolates what the middleware itself costs per delivery
// (BenchmarkMiddlewareCost); it keeps no promise and is for benchmarks only.
type nopStore struct{ tx nopTx }

type nopTx struct{ commits, fails int }

func (t *nopTx) Context(ctx context.Context) context.Context                     { return ctx }
func (t *nopTx) Commit(context.Context) error                                    { t.commits++; return nil }
func (t *nopTx) Fail(context.Context, contract.Failure) (int, error)             { t.fails++; return 0, nil }
func (s *nopStore) Check(contract.Delivery) error                                { return nil }
func (s *nopStore) NeedsProducerTime() bool                                      { return false }
func (s *nopStore) RetentionWindow() time.Duration                               { return 0 }
func (s *nopStore) Classify(error) contract.Class                                { return contract.Other }
func (s *nopStore) MarkDeadLettered(context.Context, contract.Key, string) error { return nil }
func (s *nopStore) Replay(context.Context, contract.Key) (bool, error)           { return false, nil }
func (s *nopStore) Claim(context.Context, contract.Delivery) (contract.Tx, contract.Claim, error) {
	return &s.tx, contract.Claim{Decision: contract.Run}, nil
}
func (s *nopStore) ClaimBatch(context.Context, []contract.Delivery) (contract.BatchTx, []contract.Claim, error) {
	return nil, nil, errors.New("nopStore: no batches")
}

// BenchmarkMiddlewareCost measures the middleware alone, on a store that does no I/O
// (nopStore): allocations, bytes and CPU per delivery of a message whose handler succeeds,
// for the plain inbox, the inbox with a dead-letter topic on a broker that signals first
// deliveries (dlq-signal) and on one that does not (dlq-nosignal). Run with -benchmem; the
// message (a UUID key, a 64-byte payload, two metadata fields) is built before the timer.
//
//	go test ./middleware/inbox -run '^$' -bench MiddlewareCost -benchmem
func BenchmarkMiddlewareCost(b *testing.B) {
	pub := &memPublisher{}
	first := func(*message.Message) inbox.Redelivery { return inbox.FirstDelivery }
	for _, c := range []struct {
		name string
		cfg  inbox.Config
	}{
		{"plain", inbox.Config{ConsumerName: "cost"}},
		{"dlq-signal", inbox.Config{ConsumerName: "cost", DeadLetterPublisher: pub, DeadLetterTopic: "dead", Redelivery: first}},
		{"dlq-nosignal", inbox.Config{ConsumerName: "cost", DeadLetterPublisher: pub, DeadLetterTopic: "dead"}},
	} {
		b.Run(c.name, func(b *testing.B) {
			store := &nopStore{}
			c.cfg.Store = store
			ib, err := inbox.New(c.cfg, nil)
			if err != nil {
				b.Fatal(err)
			}
			h := ib.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			msgs := make([]*message.Message, b.N)
			payload := make([]byte, 64)
			for i := range msgs {
				msgs[i] = message.NewMessage(uuid.NewString(), payload)
				msgs[i].Metadata.Set("name", "PaymentReceived")
				msgs[i].Metadata.Set("correlation_id", "c-1")
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				if _, err := h(msgs[i]); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			if got := ib.Stats().Processed; got != uint64(b.N) || store.tx.commits != b.N {
				b.Fatalf("processed %d, commits %d, want %d", got, store.tx.commits, b.N)
			}
		})
	}
}
