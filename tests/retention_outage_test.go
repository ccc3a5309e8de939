package tests

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/watermill-inbox/watermill-inbox/adapters/amqp"
	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
	"github.com/watermill-inbox/watermill-inbox/router"
)

// TestOutageThenPurgeThenReplay is failure scenario 20 end to end on RabbitMQ: a consumer
// processes 20 payments (UUIDv7 message IDs), stops; the outage outlasts the retention window
// (4 s here: 3 s of declared redelivery + 1 s of margin), and the purge deletes every inbox
// row; the producer then replays the same 20 messages, with 5 new ones, to a restarted
// consumer. None of the old ones is applied again: each is dead-lettered with the reason
// "older than the retention window" (read back from the RabbitMQ dead-letter queue and from
// the attempt records), and the 5 new ones are applied once. Every message is accounted for:
// the applied log holds each of the 25 once, the balance is their sum.
func TestOutageThenPurgeThenReplay(t *testing.T) {
	amqpURL := testenv.RequireAMQP(t)
	sch := testenv.NewSchema(t, 10)
	sch.CreateAccounts(t, 1)
	sch.Exec(t, "CREATE TABLE applied (message_id text NOT NULL, amount bigint NOT NULL)")
	store, err := pgstore.New(sch.Pool, pgstore.Config{Schema: sch.Name,
		Retention: inbox.Retention{Window: 4 * time.Second, MaxRedelivery: 3 * time.Second, Margin: time.Second, DeadLetterWindow: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	topic, dlTopic := "payments_"+sch.Name, "payments_dead_"+sch.Name
	cfg := router.Config{Broker: "amqp", URL: amqpURL}
	t.Cleanup(func() { deleteAMQPQueues(t, amqpURL, []string{topic, dlTopic}, "billing", "dl-reader") })

	// The producer and the dead-letter reader live through the whole test.
	tools, err := router.NewBroker(cfg, sch.Pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tools.Close() })
	dlSub, err := tools.NewSubscriber("dl-reader")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	dlCh, err := dlSub.Subscribe(ctx, dlTopic)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	deadLetters := map[string]string{} // UUID -> reason
	go func() {
		for m := range dlCh {
			mu.Lock()
			deadLetters[m.UUID] = m.Metadata.Get(wmmiddleware.ReasonForPoisonedKey)
			mu.Unlock()
			m.Ack()
		}
	}()

	startConsumer := func() *router.Router {
		r, err := router.New(cfg, sch.Pool, nil)
		if err != nil {
			t.Fatal(err)
		}
		ib, err := r.NewInbox(inbox.Config{Store: store, ConsumerName: "billing",
			DeadLetterPublisher: r.Broker.Publisher, DeadLetterTopic: dlTopic,
			TooOld: inbox.TooOldGuard{ProducerTime: inbox.ProducerTimeFromUUIDv7()}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.AddConsumer(ib, topic, func(msg *message.Message) error {
			tx, _ := pgstore.TxFromContext(msg.Context())
			if _, err := tx.Exec(msg.Context(), "UPDATE accounts SET balance = balance + 10 WHERE id = 1"); err != nil {
				return err
			}
			_, err := tx.Exec(msg.Context(), "INSERT INTO applied VALUES ($1, 10)", msg.UUID)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		testenv.RunRouter(t, r.Router)
		return r
	}
	count := func(q string) int64 { return queryInt(t, sch.Pool, q) }
	publish := func(ids []string) {
		for _, id := range ids {
			if err := tools.Publisher.Publish(topic, message.NewMessage(id, []byte(`{"amount":10}`))); err != nil {
				t.Fatal(err)
			}
		}
	}

	// 1. Twenty payments, processed.
	var old []string
	for i := 0; i < 20; i++ {
		old = append(old, uuid.Must(uuid.NewV7()).String())
	}
	first := startConsumer()
	publish(old)
	waitUntil(t, 30*time.Second, "20 payments applied", func() (bool, string) {
		n := count("SELECT count(*) FROM applied")
		return n == 20, "applied " + strconv.FormatInt(n, 10)
	})
	// 2. The consumer stops; the outage outlasts the window (by producer time and by the
	// rows' age).
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(4500 * time.Millisecond)
	// 3. The purge removes the evidence of all 20.
	rep, err := store.PurgeExpired(context.Background(), pgstore.PurgeExpiredParams{})
	if err != nil || rep.Tables[0].Rows != 20 || count("SELECT count(*) FROM inbox_processed_messages") != 0 {
		t.Fatalf("purge after the outage: %+v, %v", rep.Tables, err)
	}
	// 4. The old messages come again, with five new ones.
	var fresh []string
	for i := 0; i < 5; i++ {
		fresh = append(fresh, uuid.Must(uuid.NewV7()).String())
	}
	startConsumer()
	publish(append(append([]string{}, old...), fresh...))
	waitUntil(t, 30*time.Second, "5 new payments applied and 20 dead letters", func() (bool, string) {
		mu.Lock()
		dl := len(deadLetters)
		mu.Unlock()
		n := count("SELECT count(*) FROM applied")
		return n == 25 && dl == 20, "applied " + strconv.FormatInt(n, 10) + ", dead letters " + strconv.Itoa(dl)
	})
	time.Sleep(300 * time.Millisecond) // a late second application would show now

	if n, d := count("SELECT count(*) FROM applied"), count("SELECT count(DISTINCT message_id) FROM applied"); n != 25 || d != 25 {
		t.Fatalf("applied %d times, %d distinct; want each of the 25 once", n, d)
	}
	if b := count("SELECT balance FROM accounts WHERE id = 1"); b != 250 {
		t.Fatalf("balance %d, want 250", b)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, id := range old {
		if r, ok := deadLetters[id]; !ok || r != inbox.ReasonTooOld {
			t.Errorf("old message %s: dead letter %v, reason %q", id, ok, r)
		}
	}
	for _, id := range fresh {
		if _, ok := deadLetters[id]; ok {
			t.Errorf("new message %s was dead-lettered", id)
		}
	}
	if n := count("SELECT count(*) FROM inbox_processed_messages_attempts WHERE dead_lettered_at IS NOT NULL AND attempts = 0 AND dead_letter_reason = '" + inbox.ReasonTooOld + "'"); n != 20 {
		t.Fatalf("%d dead-letter records with the reason and no attempt, want 20", n)
	}
}

// deleteAMQPQueues deletes the exchanges of topics and the queues of groups on them.
func deleteAMQPQueues(t *testing.T, url string, topics []string, groups ...string) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Logf("cleanup: %v", err)
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	for _, topic := range topics {
		for _, g := range groups {
			_, _ = ch.QueueDelete(amqp.QueueName(topic, g), false, false, false)
		}
		_, _ = ch.QueueDelete(topic, false, false, false)
		_ = ch.ExchangeDelete(topic, false, false)
	}
}
