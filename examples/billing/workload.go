//go:build unix

package main

import (
	"encoding/json"
	"math/rand/v2"
	"sort"
	"strconv"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/middleware/deferred"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// Metadata of every payment, read by the store-then-process mode (deferred.go): the aggregate
// key (the account) and the producer's sequence number of the payment within its account
// (1, 2, ... in first-send order; a re-sent duplicate carries its original's).
const (
	aggregateKeyField = deferred.DefaultAggregateField
	sequenceField     = "account_seq"
)

// workload is what the orchestrator publishes and what it expects afterwards.
type workload struct {
	// ids are the unique message UUIDs, assigned once by the producer, in first-send order.
	ids []string
	// accountOf is the account of each unique payment, aligned with ids.
	accountOf []int64
	// seq is each unique payment's sequence number within its account (metadata
	// sequenceField), aligned with ids.
	seq []int64
	// deliveries are the messages in publish order: every unique payment once, plus
	// duplicates (same UUID, same payload) re-sent at random later positions.
	deliveries []*message.Message
	duplicates int
	// expected is the balance of each account: the sum of its unique payments, in cents (0
	// for the frozen account).
	expected map[int64]int64

	// frozenAccount is the account the handler refuses payments to, and poison are payments
	// to it, published after the first two crashes: poison messages.
	frozenAccount int64
	poison        []*message.Message
	poisonIDs     []string
}

// newWorkload builds the payments. With sequenced (the store-then-process mode) each payment
// carries its account as the aggregate key and its sequence number in metadata; without, the
// messages are as before (a dead letter on SQS has room for no more message attributes).
func newWorkload(rng *rand.Rand, messages, accounts int, dupRatio float64, poison int, sequenced bool) (*workload, error) {
	w := &workload{expected: make(map[int64]int64, accounts), frozenAccount: int64(accounts) + 1}
	for a := 1; a <= accounts; a++ {
		w.expected[int64(a)] = 0
	}
	w.expected[w.frozenAccount] = 0 // every payment to it is rejected
	type sendAt struct {
		pos float64
		msg *message.Message
	}
	seqOf := make(map[int64]int64, accounts+1) // last sequence number given per account
	newPaymentMessage := func(id string, payload []byte, account, seq int64) *message.Message {
		if !sequenced {
			return newPaymentMessage(id, payload, 0, 0)
		}
		return newPaymentMessage(id, payload, account, seq)
	}
	sends := make([]sendAt, 0, messages+int(float64(messages)*dupRatio)+1)
	payloads := make([][]byte, messages)
	for i := range messages {
		p := payment{AccountID: 1 + int64(rng.IntN(accounts)), AmountCents: 1 + int64(rng.IntN(10_000))}
		payload, err := json.Marshal(p)
		if err != nil {
			return nil, err
		}
		id := watermill.NewUUID()
		w.ids = append(w.ids, id)
		w.accountOf = append(w.accountOf, p.AccountID)
		payloads[i] = payload
		w.expected[p.AccountID] += p.AmountCents
		seqOf[p.AccountID]++
		w.seq = append(w.seq, seqOf[p.AccountID])
		sends = append(sends, sendAt{pos: float64(i), msg: newPaymentMessage(id, payload, p.AccountID, seqOf[p.AccountID])})
	}
	// Re-send a share of distinct payments with the same UUID and payload, each somewhere after
	// its first send, as a producer that timed out waiting for the broker's confirmation would.
	w.duplicates = int(float64(messages)*dupRatio + 0.5)
	for _, i := range rng.Perm(messages)[:w.duplicates] {
		pos := float64(i) + 0.5 + rng.Float64()*float64(messages-i)
		sends = append(sends, sendAt{pos: pos, msg: newPaymentMessage(w.ids[i], payloads[i], w.accountOf[i], w.seq[i])})
	}
	sort.SliceStable(sends, func(a, b int) bool { return sends[a].pos < sends[b].pos })
	for _, s := range sends {
		w.deliveries = append(w.deliveries, s.msg)
	}
	for range poison {
		payload, err := json.Marshal(payment{AccountID: w.frozenAccount, AmountCents: 1 + int64(rng.IntN(10_000))})
		if err != nil {
			return nil, err
		}
		id := watermill.NewUUID()
		w.poisonIDs = append(w.poisonIDs, id)
		seqOf[w.frozenAccount]++
		w.poison = append(w.poison, newPaymentMessage(id, payload, w.frozenAccount, seqOf[w.frozenAccount]))
	}
	return w, nil
}

// newPaymentMessage returns a payment message; with seq > 0 it carries account as the aggregate
// key and seq as its sequence number.
func newPaymentMessage(id string, payload []byte, account, seq int64) *message.Message {
	msg := message.NewMessage(id, payload)
	msg.Metadata.Set(inbox.DefaultMessageTypeKey, messageType)
	if seq > 0 {
		msg.Metadata.Set(aggregateKeyField, strconv.FormatInt(account, 10))
		msg.Metadata.Set(sequenceField, strconv.FormatInt(seq, 10))
	}
	return msg
}
