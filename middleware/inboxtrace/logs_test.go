package inboxtrace_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxmetrics"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxtrace"
)

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestNoPayloadInLogsOrSpans runs every outcome (processed, duplicate, collision dead letter,
// poison dead letter, skip, invalid key, transaction retry) with metrics and tracing wired and
// watermill.NewSlogLogger at its most verbose level (trace): no line and no span attribute
// holds the payload's or a metadata value's marker. It also checks the levels: a duplicate is
// logged at DEBUG, a dead letter at ERROR.
func TestNoPayloadInLogsOrSpans(t *testing.T) {
	const marker = "SECRET-PAYLOAD-7f3a"
	var buf syncBuffer
	logger := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: watermill.LevelTrace})))
	tp, exp := newProvider()
	m, err := inboxmetrics.New(prometheus.NewRegistry(), inboxmetrics.Options{})
	if err != nil {
		t.Fatal(err)
	}
	dead := &recorder{}
	obs, err := m.NewObserver("billing")
	if err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(inbox.Config{
		Store: storetest.NewMemStore(), ConsumerName: "billing", MaxAttempts: 1,
		DeadLetterPublisher: dead, DeadLetterTopic: "dead", Observer: obs,
		Tracer: inboxtrace.New(inboxtrace.Config{TracerProvider: tp, ConsumerName: "billing"}),
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	conflicted := false
	h := ib.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		switch msg.UUID {
		case "poison":
			return nil, errors.New("handler failed")
		case "conflict":
			if !conflicted {
				conflicted = true
				return nil, storetest.ErrConflict
			}
		}
		return nil, nil
	})
	deliver := func(id, payload string) {
		msg := message.NewMessage(id, []byte(payload+" "+marker))
		msg.Metadata.Set("card_number", marker)
		msg.SetContext(context.Background())
		_, _ = h(msg)
	}
	deliver("ok", "a")
	deliver("ok", "a")       // duplicate
	deliver("ok", "b")       // collision, dead-lettered
	deliver("poison", "p")   // dead-lettered
	deliver("poison", "p")   // skipped
	deliver("", "no key")    // invalid key, dead-lettered
	deliver("conflict", "c") // one transaction retry
	deliver("bad\nid", "c")  // a control character in the ID

	out := buf.String()
	if strings.Contains(out, marker) {
		t.Fatalf("a log line holds the payload or a metadata value:\n%s", out)
	}
	for _, want := range []string{`level=DEBUG msg="Duplicate message skipped"`, `level=ERROR msg="Message dead-lettered"`, "Transient conflict"} {
		if !strings.Contains(out, want) {
			t.Errorf("no log line %q in:\n%s", want, out)
		}
	}
	for _, sp := range exp.GetSpans() {
		for _, kv := range sp.Attributes {
			if strings.Contains(kv.Value.Emit(), marker) {
				t.Errorf("span %s attribute %s holds the marker", sp.Name, kv.Key)
			}
		}
		for _, ev := range sp.Events {
			for _, kv := range ev.Attributes {
				if strings.Contains(kv.Value.Emit(), marker) {
					t.Errorf("span %s event %s holds the marker", sp.Name, ev.Name)
				}
			}
		}
	}
	if s := ib.Stats(); s.Processed != 3 || s.DeadLettered != 3 || s.TxRetries != 1 || len(dead.msgs) != 3 {
		t.Fatalf("stats %+v, %d dead letters: the scenario did not run as intended", s, len(dead.msgs))
	}
}
