// Package inboxtrace traces the inbox with OpenTelemetry: a span per delivery that continues
// the producer's trace (W3C traceparent in the message metadata), child spans for the claim,
// the handler and the commit (and the dead-letter publish), the messaging semantic-convention
// attributes and the inbox outcome; dead letters and the messages a handler stores in the
// outbox carry the trace onward. It implements inbox.Tracer, and lives apart from the core
// package inbox, so a program that does not trace does not link OpenTelemetry.
//
//	tp := sdktrace.NewTracerProvider(...) // yours
//	ib, err := inbox.New(inbox.Config{Store: store, ConsumerName: "billing",
//		Tracer: inboxtrace.New(inboxtrace.Config{TracerProvider: tp, ConsumerName: "billing", System: "rabbitmq"})}, logger)
//
// Nothing global is read or set unless you leave TracerProvider nil (then the global provider
// is used, a no-op unless your program set one). docs/observability.md lists every span and
// attribute.
package inboxtrace

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// ScopeName is the instrumentation scope of the spans (the tracer's name).
const ScopeName = "github.com/watermill-inbox/watermill-inbox/middleware/inboxtrace"

// Attribute keys of the inbox, beside the messaging semantic conventions.
const (
	// OutcomeKey holds the delivery's inbox.Outcome ("processed", "duplicate", "collision",
	// "dead_lettered", "dead_lettered_skip", "failed_retryable", "failed_final").
	OutcomeKey = attribute.Key("watermill_inbox.outcome")
	// AttemptsKey holds the message's durable attempt count after the delivery (with dead
	// letters configured).
	AttemptsKey = attribute.Key("watermill_inbox.attempts")
	// TxRetriesKey holds the in-process transaction retries of the delivery.
	TxRetriesKey = attribute.Key("watermill_inbox.tx_retries")
	// CollisionKey is true on a key collision.
	CollisionKey = attribute.Key("watermill_inbox.key_collision")
	// InvalidKeyKey is true when the message's key was missing or invalid.
	InvalidKeyKey = attribute.Key("watermill_inbox.invalid_key")
	// DeadLetterReasonKey holds the dead-letter reason of a dead-lettered delivery.
	DeadLetterReasonKey = attribute.Key("watermill_inbox.dead_letter_reason")
)

// maxIDBytes bounds the message ID recorded in messaging.message.id (a Watermill UUID has no
// length limit; a key has inbox.MaxKeyBytes).
const maxIDBytes = inbox.MaxKeyBytes

// Config configures a Tracer.
type Config struct {
	// TracerProvider creates the tracer. Default: otel.GetTracerProvider(), the global one,
	// which is a no-op unless the program set it.
	TracerProvider trace.TracerProvider
	// Propagator reads the producer's trace context from the message metadata and writes it
	// into dead letters and produced messages. Default: W3C Trace Context and Baggage
	// (traceparent, tracestate, baggage), never the global propagator.
	Propagator propagation.TextMapPropagator
	// ConsumerName is the inbox's consumer name (messaging.consumer.group.name).
	ConsumerName string
	// System is messaging.system: the broker, e.g. "rabbitmq", "kafka", "aws_sqs",
	// "redis", "nats", "postgresql". Default: "watermill".
	System string
}

// Tracer implements inbox.Tracer with OpenTelemetry. Set it as Config.Tracer of one inbox.
// It is safe for concurrent use.
type Tracer struct {
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
	attrs  []attribute.KeyValue
}

var _ inbox.Tracer = (*Tracer)(nil)

// New returns a Tracer for the inbox of cfg.ConsumerName.
func New(cfg Config) *Tracer {
	tp := cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	prop := cfg.Propagator
	if prop == nil {
		prop = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
	}
	system := cfg.System
	if system == "" {
		system = "watermill"
	}
	attrs := []attribute.KeyValue{
		semconv.MessagingSystemKey.String(system),
		semconv.MessagingOperationName("process"),
		semconv.MessagingOperationTypeProcess,
	}
	if cfg.ConsumerName != "" {
		attrs = append(attrs, semconv.MessagingConsumerGroupName(cfg.ConsumerName))
	}
	return &Tracer{tracer: tp.Tracer(ScopeName), prop: prop, attrs: attrs}
}

// StartDelivery starts the delivery span "process <topic>" (kind consumer). Its parent is the
// span already in ctx (a tracing middleware outside the inbox), else the trace context the
// producer put in the message metadata, else none (a new trace).
func (t *Tracer) StartDelivery(ctx context.Context, msg *message.Message) (context.Context, func(inbox.Result)) {
	if !trace.SpanContextFromContext(ctx).IsValid() && msg.Metadata != nil {
		ctx = t.prop.Extract(ctx, propagation.MapCarrier(msg.Metadata))
	}
	topic := message.SubscribeTopicFromCtx(ctx)
	name := "process"
	attrs := append(make([]attribute.KeyValue, 0, len(t.attrs)+2), t.attrs...)
	if topic != "" {
		name += " " + topic
		attrs = append(attrs, semconv.MessagingDestinationName(topic))
	}
	id := msg.UUID
	if len(id) > maxIDBytes {
		id = id[:maxIDBytes]
	}
	attrs = append(attrs, semconv.MessagingMessageID(id))
	ctx, span := t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
	return ctx, func(r inbox.Result) {
		span.SetAttributes(OutcomeKey.String(r.Outcome.String()), TxRetriesKey.Int(r.TxRetries))
		if r.Attempts > 0 {
			span.SetAttributes(AttemptsKey.Int(r.Attempts))
		}
		if r.Collision {
			span.SetAttributes(CollisionKey.Bool(true))
		}
		if r.Key.MessageID == "" {
			span.SetAttributes(InvalidKeyKey.Bool(true))
		}
		switch r.Outcome {
		case inbox.OutcomeDeadLettered:
			span.SetAttributes(DeadLetterReasonKey.String(r.Reason))
			span.SetStatus(codes.Error, "dead-lettered")
		case inbox.OutcomeFailedRetryable, inbox.OutcomeFailedFinal:
			if r.Err != nil {
				span.RecordError(r.Err)
			}
			span.SetStatus(codes.Error, r.Outcome.String())
		}
		span.End()
	}
}

// StartPhase starts the child span "inbox <phase>" (kind internal): "inbox claim", "inbox
// handler", "inbox commit", "inbox dead_letter". The handler's message context holds the
// handler span, so the handler's own spans are its children. A phase that ends with an error
// records it and has status Error.
func (t *Tracer) StartPhase(ctx context.Context, p inbox.Phase) (context.Context, func(error)) {
	ctx, span := t.tracer.Start(ctx, "inbox "+p.String(), trace.WithSpanKind(trace.SpanKindInternal))
	return ctx, func(err error) {
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

// Inject writes the trace context of ctx into md. A dead letter's trace context is replaced by
// the dead-letter span's, so a reader of the dead-letter topic continues the delivery's trace;
// a produced message keeps a valid trace context its handler set itself, and otherwise gets
// the handler span's.
func (t *Tracer) Inject(ctx context.Context, p inbox.Phase, md message.Metadata) {
	carrier := propagation.MapCarrier(md)
	if p == inbox.PhaseHandler && trace.SpanContextFromContext(t.prop.Extract(context.Background(), carrier)).IsValid() {
		return
	}
	for _, f := range t.prop.Fields() {
		delete(md, f)
	}
	t.prop.Inject(ctx, carrier)
}
