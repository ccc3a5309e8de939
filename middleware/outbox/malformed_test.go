package outbox_test

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/watermill-inbox/watermill-inbox/middleware/outbox"
)

// insertRow inserts one outbox row directly (as anything with INSERT on the table could) and
// returns its offset.
func insertRow(t *testing.T, e *env, uuid, payload, metadata string) int64 {
	t.Helper()
	return e.int(`INSERT INTO `+e.cfg.MessagesTable()+` (uuid, payload, metadata, transaction_id)
		VALUES ($1, $2::json, $3::json, pg_current_xact_id()) RETURNING "offset"`, uuid, payload, metadata)
}

const goodEnvelope = `{"destination_topic":"events","uuid":"%s","payload":"e30=","metadata":{"k":"v"}}`

// TestRelaySkipsAndReportsRowsItCannotRead: rows whose metadata column watermill-sql cannot
// read (a JSON array, a map with a number, a map with a nested object, a JSON string) used to
// fail every poll and stop the relay forever. Each is now skipped, logged at ERROR and passed
// to OnMalformedRow with its offset; the valid rows around them, before and after, are all
// relayed, the group's offset passes the last row and Stats counts the skipped rows.
func TestRelaySkipsAndReportsRowsItCannotRead(t *testing.T) {
	e := newEnv(t, 4)
	ob, err := outbox.New(e.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	before := storeRows(t, e, ob, "before", 5, 5, 1)
	bad := map[int64]string{}
	for _, md := range []string{`["a","b"]`, `{"k":1}`, `{"k":{"nested":"x"}}`, `"just a string"`} {
		off := insertRow(t, e, "bad-"+md, strings.Replace(goodEnvelope, "%s", "bad-inner", 1), md)
		bad[off] = md
	}
	after := storeRows(t, e, ob, "after", 5, 5, 1)

	pub := &recordingPublisher{}
	logs := &levelCounter{}
	var mu sync.Mutex
	var reported []outbox.MalformedRow
	r, err := outbox.NewRelay(outbox.RelayConfig{Config: e.cfg, Pool: e.sch.Pool, Publisher: pub, PollInterval: 20 * time.Millisecond,
		OnMalformedRow: func(row outbox.MalformedRow) {
			mu.Lock()
			defer mu.Unlock()
			reported = append(reported, row)
		}}, logs)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = r.Run(t.Context()) }()
	t.Cleanup(func() { _ = r.Close() })

	got := waitRelayed(t, pub, len(before)+len(after), 15*time.Second)
	waitAllAcked(t, e, "")
	stopRelay(t, r)
	want := map[string]bool{}
	for _, id := range append(before, after...) {
		want[id] = true
	}
	for _, m := range pub.snapshot() {
		if !want[m.UUID] {
			t.Fatalf("relayed %q, which is not a valid row's message", m.UUID)
		}
	}
	if len(got) != len(want) {
		t.Fatalf("relayed %d messages, want %d", len(got), len(want))
	}
	mu.Lock()
	defer mu.Unlock()
	if len(reported) != len(bad) {
		t.Fatalf("reported %d malformed rows (%+v), want %d", len(reported), reported, len(bad))
	}
	for _, row := range reported {
		if _, ok := bad[row.Offset]; !ok || !row.Skipped || !strings.Contains(row.Reason, "metadata") || row.TransactionID == 0 {
			t.Fatalf("reported %+v; bad rows at offsets %v", row, bad)
		}
	}
	if st := r.Stats(); st.MalformedSkipped != int64(len(bad)) || st.Relayed != int64(len(want)) {
		t.Fatalf("stats %+v, want %d skipped and %d relayed", st, len(bad), len(want))
	}
	logs.mu.Lock()
	defer logs.mu.Unlock()
	if len(logs.errors) != len(bad) {
		t.Fatalf("ERROR lines %q, want one per malformed row", logs.errors)
	}
}

// TestRelayStopsLoudlyAtAnEnvelopeItCannotUnwrap: a row whose payload is not a forwarder
// envelope (no destination topic; an envelope whose metadata holds a number) stops its
// consumer group when AckWhenCannotUnwrap is false, as documented, but never silently: every
// retry logs an ERROR naming the row's offset and calls OnMalformedRow (Skipped false), the
// rows after it stay pending (Lag counts them), and once the row is deleted the relay goes on.
func TestRelayStopsLoudlyAtAnEnvelopeItCannotUnwrap(t *testing.T) {
	for name, payload := range map[string]string{
		"no destination topic": `{"uuid":"x","payload":"e30="}`,
		"number in metadata":   `{"destination_topic":"events","uuid":"x","payload":"e30=","metadata":{"k":1}}`,
		"envelope is an array": `[1,2,3]`,
		"payload not base64ed": `{"destination_topic":"events","uuid":"x","payload":"***"}`,
	} {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, 4)
			ob, err := outbox.New(e.cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			badOffset := insertRow(t, e, "bad", payload, `{}`)
			after := storeRows(t, e, ob, "after", 3, 3, 1)
			pub := &recordingPublisher{}
			logs := &levelCounter{}
			var mu sync.Mutex
			var reported []outbox.MalformedRow
			r, err := outbox.NewRelay(outbox.RelayConfig{Config: e.cfg, Pool: e.sch.Pool, Publisher: pub,
				PollInterval: 10 * time.Millisecond, ResendInterval: 10 * time.Millisecond, AckDeadline: 300 * time.Millisecond,
				OnMalformedRow: func(row outbox.MalformedRow) {
					mu.Lock()
					defer mu.Unlock()
					reported = append(reported, row)
				}}, logs)
			if err != nil {
				t.Fatal(err)
			}
			go func() { _ = r.Run(t.Context()) }()
			t.Cleanup(func() { _ = r.Close() })
			deadline := time.Now().Add(10 * time.Second)
			for {
				mu.Lock()
				n := len(reported)
				mu.Unlock()
				if n >= 3 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the stopping row was reported %d times in 10 s, want it at every retry", n)
				}
				time.Sleep(10 * time.Millisecond)
			}
			mu.Lock()
			for _, row := range reported {
				if row.Offset != badOffset || row.Skipped || row.UUID != "bad" {
					t.Fatalf("reported %+v, want offset %d, not skipped", row, badOffset)
				}
			}
			mu.Unlock()
			if got := pub.snapshot(); len(got) != 0 {
				t.Fatalf("relayed %d messages past a row it stops at", len(got))
			}
			lag, err := r.Lag(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if lag.Pending != int64(1+len(after)) {
				t.Fatalf("lag %+v, want %d pending", lag, 1+len(after))
			}
			logs.mu.Lock()
			loud := len(logs.errors) > 0 && strings.Contains(logs.errors[0], "cannot unwrap")
			logs.mu.Unlock()
			if !loud {
				t.Fatalf("no ERROR line about the row: %q", logs.errors)
			}

			e.mustExec(`DELETE FROM `+e.cfg.MessagesTable()+` WHERE "offset" = $1`, badOffset)
			waitRelayed(t, pub, len(after), 10*time.Second)
			waitAllAcked(t, e, "")
		})
	}
}
