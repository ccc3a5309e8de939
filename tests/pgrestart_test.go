package tests

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"sort"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-inbox/watermill-inbox/internal/testenv"
)

// restartPostgres restarts the machine's PostgreSQL cluster with a fast shutdown (every
// session is terminated, open transactions roll back) and returns how long it took.
// pg_ctlcluster returns once the server accepts connections again.
func restartPostgres(t testing.TB) time.Duration {
	t.Helper()
	ents, err := os.ReadDir("/etc/postgresql")
	if err != nil || len(ents) == 0 {
		t.Fatalf("find the PostgreSQL cluster version in /etc/postgresql: %v (%d entries)", err, len(ents))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	out, err := exec.CommandContext(ctx, "pg_ctlcluster", "--skip-systemctl-redirect", ents[0].Name(), "main", "restart", "-m", "fast").CombinedOutput()
	if err != nil {
		t.Fatalf("pg_ctlcluster restart: %v\n%s", err, out)
	}
	return time.Since(start)
}

// waitPostgresReady polls until a fresh connection to dsn runs a query, or fails t after
// timeout.
func waitPostgresReady(t testing.TB, dsn string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn, err := pgx.Connect(ctx, dsn)
		if err == nil {
			_, err = conn.Exec(ctx, "SELECT 1")
			_ = conn.Close(ctx)
		}
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("PostgreSQL did not accept connections within %s: %v", timeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestPostgresRestartMidStream restarts PostgreSQL (fast shutdown) while 500 messages, 50 of
// them duplicates of earlier ones by UUID, stream through RabbitMQ to four competing
// consumers. Deliveries in flight during the outage fail (claim, update or commit), the inbox
// returns the error, the router nacks and RabbitMQ requeues; the pgx pool replaces its dead
// connections; every message still ends processed exactly once.
//
// It restarts the shared PostgreSQL server, so it runs only when asked to: with
// INBOX_TEST_RESTART_SERVICES=1 (testenv.EnvRestartServices), which make test sets; otherwise
// it skips. It must not run beside other tests using the server (not t.Parallel; the Makefile
// runs packages with -p 1), and it waits for PostgreSQL to be back before it ends, even when
// it fails.
func TestPostgresRestartMidStream(t *testing.T) {
	testenv.RequireRestartOptIn(t, "PostgreSQL")
	streamThroughOutage(t, "PostgreSQL", func(t *testing.T, schema *testenv.Schema) time.Duration {
		took := restartPostgres(t)
		waitPostgresReady(t, schema.URL, 30*time.Second)
		return took
	})
}

// streamThroughOutage streams 500 payments (50 duplicates) through RabbitMQ to four
// competing inbox consumers and calls outage once 100 are processed; afterwards every message
// must end processed exactly once. what names the restarted service in logs.
func streamThroughOutage(t *testing.T, what string, outage func(*testing.T, *testenv.Schema) time.Duration) {
	start := time.Now()
	schema := testenv.NewSchema(t, 4)
	// Registered after NewSchema, so it runs before the schema is dropped.
	t.Cleanup(func() { waitPostgresReady(t, schema.URL, 60*time.Second) })
	rabbit := newRabbitAdmin(t)
	const accounts = 10
	store := setupBank(t, schema, accounts)
	queue := rabbit.newQueue(t)

	// 450 unique payments; every tenth publish repeats an earlier payment (same UUID, same
	// payload), as a producer retry would.
	const total, dupEvery = 500, 10
	var stream []*message.Message
	var unique []*message.Message
	want := map[int]int64{}
	for k := 0; k < total; k++ {
		if k%dupEvery == dupEvery-1 {
			orig := unique[rand.IntN(len(unique))]
			stream = append(stream, message.NewMessage(orig.UUID, orig.Payload))
			continue
		}
		i := len(unique)
		account, amount := i%accounts+1, int64(i+1)
		m := paymentMsg(t, watermill.NewUUID(), account, amount)
		unique = append(unique, m)
		stream = append(stream, m)
		want[account] += amount
	}

	logger := &countingLogger{}
	pool := testenv.NewPool(t, schema.URL, 8)
	c := startConsumer(t, consumerConfig{
		Pool:          pool,
		Schema:        schema.Name,
		AMQPURL:       rabbit.url,
		Queue:         queue,
		Subscriptions: 4,
		Logger:        logger,
		// Hold each transaction open a little, so the fast shutdown finds transactions in
		// flight (between claim and commit) and not only idle connections.
		AfterUpdate: func(*message.Message) error { time.Sleep(5 * time.Millisecond); return nil },
	})

	// Publish at a steady pace (about 2 s in all), so messages keep arriving through the outage.
	published := make(chan struct{})
	go func() {
		defer close(published)
		for _, m := range stream {
			// A broker outage fails publishes for a while: retry, as a producer would.
			for attempt := 0; ; attempt++ {
				err := rabbit.pub.Publish(queue, m)
				if err == nil {
					break
				}
				if attempt == 300 {
					t.Errorf("publish: %v", err)
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
			time.Sleep(3 * time.Millisecond)
		}
	}()
	t.Cleanup(func() { <-published })

	inboxRows := "SELECT count(*) FROM " + store.Table()
	waitUntil(t, 20*time.Second, "the first 100 messages to be processed", func() (bool, string) {
		n, err := tryQueryInt(schema.Pool, inboxRows)
		return err == nil && n >= 100, fmt.Sprintf("inbox rows=%d err=%v", n, err)
	})
	before := queryInt(t, schema.Pool, inboxRows)
	restartStart := time.Since(start)
	took := outage(t, schema)
	failedDuringOutage := c.Inbox.Stats().Failed
	t.Logf("restarted %s at %s with %d/%d messages processed, in %s; %d deliveries failed meanwhile",
		what, restartStart.Round(time.Millisecond), before, len(unique), took.Round(time.Millisecond), failedDuringOutage)
	if before >= int64(len(unique)) {
		t.Fatalf("every message was processed before the restart: the test did not restart mid-stream")
	}

	select {
	case <-published:
	case <-time.After(60 * time.Second):
		t.Fatal("publishing did not finish within 60s")
	}
	waitUntil(t, 60*time.Second, "every delivery to be acked after the restart", func() (bool, string) {
		n, err := tryQueryInt(schema.Pool, inboxRows)
		ok := c.Succeeded.Load()
		// >= so that over-processing ends the wait and fails on the exact assertions below.
		return err == nil && n >= int64(len(unique)) && ok >= total,
			fmt.Sprintf("inbox rows=%d/%d acked=%d/%d err=%v stats=%+v", n, len(unique), ok, total, err, c.Inbox.Stats())
	})
	time.Sleep(ackGrace)
	if err := c.Close(); err != nil {
		t.Errorf("close consumer: %v", err)
	}
	drained := time.Since(start)

	// Verify on a fresh connection, independent of the pools that lived through the restart.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, schema.URL)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	defer conn.Close(context.Background())

	for account := 1; account <= accounts; account++ {
		if got := queryInt(t, conn, "SELECT balance FROM accounts WHERE id = $1", account); got != want[account] {
			t.Errorf("account %d balance = %d, want %d (sum of its unique payments)", account, got, want[account])
		}
	}
	rows, err := conn.Query(ctx, "SELECT message_id FROM "+store.Table()+" WHERE consumer_name = $1 ORDER BY message_id", bankConsumerName)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	var wantIDs []string
	for _, m := range unique {
		wantIDs = append(wantIDs, m.UUID)
	}
	sort.Strings(wantIDs)
	if fmt.Sprint(ids) != fmt.Sprint(wantIDs) {
		t.Errorf("inbox holds %d message IDs, want the %d unique published IDs", len(ids), len(wantIDs))
	}

	st := c.Inbox.Stats()
	// A PostgreSQL outage only fails handlers, which nack: every published message is acked
	// once. A broker outage also loses acks sent over the dropped connection, and RabbitMQ
	// redelivers those messages: more deliveries than messages, the extra ones duplicates.
	brokerOutage := what != "PostgreSQL"
	if got := c.Succeeded.Load(); got != total && !(brokerOutage && got > total) {
		t.Errorf("acked deliveries = %d, want %d (one per published message)", got, total)
	}
	if settled := st.Processed + st.Duplicates; (settled != total && !(brokerOutage && settled > total)) ||
		st.Processed > uint64(len(unique)) || st.Duplicates < total-uint64(len(unique)) {
		t.Errorf("stats = %+v: want processed+duplicates = %d, processed <= %d, duplicates >= %d", st, total, len(unique), total-len(unique))
	}
	if st.Failed == 0 && what == "PostgreSQL" {
		t.Errorf("no delivery failed: the restart did not hit in-flight work (stats %+v)", st)
	}
	if ready, consumers := rabbit.queueState(t, queue); ready != 0 || consumers != 0 {
		t.Errorf("queue after the consumers stopped: ready=%d consumers=%d, want 0 and 0", ready, consumers)
	}
	// The consumers' pool recovered: it runs queries on new connections.
	if _, err := pool.Exec(ctx, "SELECT 1"); err != nil {
		t.Errorf("consumer pool after the restart: %v", err)
	}
	t.Logf("drained at %s; stats %+v (processed after a failed commit count as duplicates); %s",
		drained.Round(time.Millisecond), st, logger.summary())
}
