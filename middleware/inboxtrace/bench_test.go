package inboxtrace_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxmetrics"
	"github.com/watermill-inbox/watermill-inbox/middleware/inboxtrace"
)

// BenchmarkObservabilityOverhead measures what the hooks cost per delivery on the in-memory
// reference store (no database, so the cost is not hidden behind a round trip):
//
//	go test -run '^$' -bench BenchmarkObservabilityOverhead -benchtime 20000x -count 3 ./middleware/inboxtrace/
func BenchmarkObservabilityOverhead(b *testing.B) {
	for _, c := range []string{"bare", "metrics", "metrics+tracing"} {
		b.Run(c, func(b *testing.B) {
			cfg := inbox.Config{Store: storetest.NewMemStore(), ConsumerName: "bench"}
			if c != "bare" {
				m, err := inboxmetrics.New(prometheus.NewRegistry(), inboxmetrics.Options{})
				if err != nil {
					b.Fatal(err)
				}
				cfg.Observer, _ = m.NewObserver("bench")
			}
			if c == "metrics+tracing" {
				tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(sdktrace.NewSimpleSpanProcessor(tracetest.NewNoopExporter())))
				cfg.Tracer = inboxtrace.New(inboxtrace.Config{TracerProvider: tp, ConsumerName: "bench"})
			}
			ib, err := inbox.New(cfg, nil)
			if err != nil {
				b.Fatal(err)
			}
			h := ib.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			b.ResetTimer()
			for i := range b.N {
				msg := message.NewMessage(strconv.Itoa(i), []byte("x"))
				msg.SetContext(context.Background())
				if _, err := h(msg); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
