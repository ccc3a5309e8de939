package inbox

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Phase names one step of a delivery, for a Tracer.
type Phase int

const (
	// PhaseClaim: taking a connection, counting the attempt, BEGIN and the claim insert,
	// including the wait behind a concurrent copy of the message that holds the key's lock
	// (Result.Claim measures the same span of time). Once per transaction: a transaction
	// retried after a conflict has a claim phase per try.
	PhaseClaim Phase = iota + 1
	// PhaseHandler: the handler, and the storing of the messages it returned in the outbox.
	// The handler's message context is the context StartPhase returns for it.
	PhaseHandler
	// PhaseCommit: COMMIT of the inbox transaction.
	PhaseCommit
	// PhaseDeadLetter: publishing the dead letter (and recording the dead-lettered state).
	PhaseDeadLetter
)

// String returns the phase's name as used in span names and logs: "claim", "handler",
// "commit", "dead_letter".
func (p Phase) String() string {
	switch p {
	case PhaseClaim:
		return "claim"
	case PhaseHandler:
		return "handler"
	case PhaseCommit:
		return "commit"
	case PhaseDeadLetter:
		return "dead_letter"
	}
	return "unknown"
}

// Tracer is told where each delivery and each of its phases start and end, with their
// contexts, so a tracing package (middleware/inboxtrace for OpenTelemetry) can open a span per
// delivery and child spans per phase, and put them in the handler's context (Config.Tracer).
// The core package knows no tracing library: it only passes contexts through. Every method
// runs on the delivery's goroutine and must not block.
type Tracer interface {
	// StartDelivery is called once per delivery, when the middleware is entered, with the
	// message as received (read it; do not change it) and its context. The context it returns
	// becomes the delivery's: every phase's context, the handler's and the Observer's derive
	// from it, so it must keep ctx's values and cancellation (derive it from ctx). end is
	// called exactly once, with the delivery's Result, when the outcome is settled (before
	// Config.Observer), also when the handler panics.
	StartDelivery(ctx context.Context, msg *message.Message) (_ context.Context, end func(Result))
	// StartPhase is called when phase p begins, with the delivery's context. The context it
	// returns is the phase's (derived from ctx); end is called exactly once when the phase
	// ends, with its error (nil on success; for PhaseClaim, a duplicate is a success).
	StartPhase(ctx context.Context, p Phase) (_ context.Context, end func(error))
	// Inject writes the trace context of ctx into md, so the trace goes on downstream. It is
	// called on every dead letter before its publish (p is PhaseDeadLetter, ctx that phase's)
	// and on every message a handler returns before the outbox stores it (p is PhaseHandler,
	// ctx the handler's). md is never nil.
	Inject(ctx context.Context, p Phase, md message.Metadata)
}

// DeadLetterTopic returns the configured dead-letter topic, "" when dead letters are off
// (for readiness checks: middleware/health).
func (i *Inbox) DeadLetterTopic() string { return i.cfg.DeadLetterTopic }

// startDelivery calls Config.Tracer.StartDelivery and keeps its end function in d.
func (i *Inbox) startDelivery(d *delivery) {
	if i.cfg.Tracer == nil {
		return
	}
	ctx, end := i.cfg.Tracer.StartDelivery(d.ctx, d.msg)
	if ctx != nil {
		d.ctx = ctx
	}
	d.traceEnd = end
}

// endDelivery calls the delivery's Tracer end function once; a panic in it is logged, never
// taken for the handler's.
func (i *Inbox) endDelivery(d *delivery) {
	end := d.traceEnd
	if end == nil {
		return
	}
	d.traceEnd = nil
	defer func() {
		if p := recover(); p != nil {
			i.logger.Error("Tracer panicked", fmt.Errorf("%v", p), watermill.LogFields{"message_uuid": safeUUID(d.msg.UUID)})
		}
	}()
	end(d.res)
}

// startPhase calls Config.Tracer.StartPhase; without a Tracer it returns ctx and a no-op.
func (i *Inbox) startPhase(ctx context.Context, p Phase) (context.Context, func(error)) {
	if i.cfg.Tracer == nil {
		return ctx, func(error) {}
	}
	pctx, end := i.cfg.Tracer.StartPhase(ctx, p)
	if pctx == nil {
		pctx = ctx
	}
	if end == nil {
		end = func(error) {}
	}
	return pctx, end
}

// inject calls Config.Tracer.Inject on m's metadata, creating the map when it is nil.
func (i *Inbox) inject(ctx context.Context, p Phase, m *message.Message) {
	if i.cfg.Tracer == nil || m == nil {
		return
	}
	if m.Metadata == nil {
		m.Metadata = message.Metadata{}
	}
	i.cfg.Tracer.Inject(ctx, p, m.Metadata)
}
