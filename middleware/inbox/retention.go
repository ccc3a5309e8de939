package inbox

import (
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-inbox/watermill-inbox/internal/keyrule"
)

// Defaults of Retention (docs/retention.md explains how to choose each).
const (
	// DefaultMaxRedelivery is the declared longest time after its first delivery that a copy
	// of a message can still arrive (the broker's longest redelivery delay, a dead-letter
	// replay, an offset reset or topic replay an operator may run): 7 days.
	DefaultMaxRedelivery = 7 * 24 * time.Hour
	// DefaultRetentionMargin is added to MaxRedelivery to get the shortest accepted
	// retention window: 1 day.
	DefaultRetentionMargin = 24 * time.Hour
	// DefaultRetentionWindow is the retention window when none is set: 14 days (the seed's
	// placeholder; at least DefaultMaxRedelivery + DefaultRetentionMargin).
	DefaultRetentionWindow = 14 * 24 * time.Hour
	// DefaultDeadLetterWindow is how long a dead-lettered attempt record is kept when none
	// is set: 30 days. It is evidence an operator needs until the message is replayed.
	DefaultDeadLetterWindow = 30 * 24 * time.Hour
	// DefaultMaxClockSkew is how far in the future a producer time may lie before the
	// message is refused (TooOldGuard): 5 minutes.
	DefaultMaxClockSkew = 5 * time.Minute
)

// The dead-letter reasons of the TooOldGuard.
const (
	// ReasonTooOld is the dead-letter reason of a message whose producer time is older than
	// the retention window: its inbox row may already be purged, so it cannot be
	// deduplicated.
	ReasonTooOld = "older than the retention window"
	// ReasonFutureProducerTime is the dead-letter reason of a message whose producer time
	// lies further in the future than TooOldGuard.MaxClockSkew.
	ReasonFutureProducerTime = "producer time in the future beyond the allowed clock skew"
)

// Retention is a store's retention setting: how long the evidence that a message was
// processed is kept. Purging a row before the last possible redelivery of its message lets
// that duplicate through silently, so the window is validated against a declared longest
// redelivery window plus a margin.
type Retention struct {
	// Window is how long processed rows (and attempt records of messages neither processed
	// nor dead-lettered) are kept, measured from when they were written. Default:
	// DefaultRetentionWindow. Must be at least MaxRedelivery + Margin.
	Window time.Duration
	// MaxRedelivery declares the longest time a copy of a message can arrive after the first
	// one: the broker's longest redelivery delay, dead-letter replays, offset resets and
	// topic replays you support. Default: DefaultMaxRedelivery.
	MaxRedelivery time.Duration
	// Margin is added to MaxRedelivery. Default: DefaultRetentionMargin.
	Margin time.Duration
	// DeadLetterWindow is how long a dead-lettered attempt record is kept, from when it was
	// dead-lettered. Default: DefaultDeadLetterWindow, or Window when that is longer. Must be
	// at least Window.
	DeadLetterWindow time.Duration
}

// WithDefaults returns r with zero fields set to the defaults documented on each field.
func (r Retention) WithDefaults() Retention {
	if r.Window == 0 {
		r.Window = DefaultRetentionWindow
	}
	if r.MaxRedelivery == 0 {
		r.MaxRedelivery = DefaultMaxRedelivery
	}
	if r.Margin == 0 {
		r.Margin = DefaultRetentionMargin
	}
	if r.DeadLetterWindow == 0 {
		r.DeadLetterWindow = max(DefaultDeadLetterWindow, r.Window)
	}
	return r
}

// RetentionError reports a retention setting that is refused. It wraps ErrInvalidConfig.
type RetentionError struct {
	// Field names the setting at fault: "Window", "MaxRedelivery", "Margin" or
	// "DeadLetterWindow".
	Field string
	// Retention is the refused setting, defaults filled.
	Retention Retention
	// Reason says why.
	Reason string
}

// Error returns "inbox: invalid configuration: retention <field>: <reason>".
func (e *RetentionError) Error() string {
	return fmt.Sprintf("%v: retention %s: %s", ErrInvalidConfig, e.Field, e.Reason)
}

// Unwrap returns ErrInvalidConfig.
func (e *RetentionError) Unwrap() error { return ErrInvalidConfig }

// Validate fills defaults and returns a *RetentionError when a duration is negative, when
// Window is shorter than MaxRedelivery + Margin (a row could be purged while a copy of its
// message can still arrive: that copy would be processed again), or when DeadLetterWindow is
// shorter than Window.
func (r Retention) Validate() error {
	r = r.WithDefaults()
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"Window", r.Window}, {"MaxRedelivery", r.MaxRedelivery}, {"Margin", r.Margin}, {"DeadLetterWindow", r.DeadLetterWindow}} {
		if f.d < 0 {
			return &RetentionError{Field: f.name, Retention: r, Reason: "must not be negative"}
		}
	}
	if need := r.MaxRedelivery + r.Margin; r.Window < need {
		return &RetentionError{Field: "Window", Retention: r, Reason: fmt.Sprintf(
			"%s is shorter than the longest redelivery window (%s) plus the margin (%s) = %s: a row purged before the last possible redelivery of its message lets that duplicate through; lengthen Window or declare a shorter MaxRedelivery",
			r.Window, r.MaxRedelivery, r.Margin, need)}
	}
	if r.DeadLetterWindow < r.Window {
		return &RetentionError{Field: "DeadLetterWindow", Retention: r, Reason: fmt.Sprintf(
			"%s is shorter than the retention window %s: dead-lettered records are evidence an operator needs until replayed", r.DeadLetterWindow, r.Window)}
	}
	return nil
}

// ProducerTimeFunc returns when the producer created msg: ok is false when msg carries no
// producer time (the check is then skipped); err reports a producer time that is present but
// unreadable (the message is then refused as permanent).
type ProducerTimeFunc func(msg *message.Message) (t time.Time, ok bool, err error)

// ProducerTimeFromUUIDv7 reads the producer time from the message UUID when it is a UUIDv7
// (RFC 9562: its first 48 bits are the Unix time in milliseconds). Any other UUID, or a
// message ID that is not a UUID, has no producer time.
func ProducerTimeFromUUIDv7() ProducerTimeFunc {
	return func(msg *message.Message) (time.Time, bool, error) {
		t, ok := keyrule.UUIDv7Time(msg.UUID)
		return t, ok, nil
	}
}

// ProducerTimeFromMetadata reads the producer time from a metadata field the producer sets
// when it creates the message: RFC 3339 (with or without fractional seconds) or decimal Unix
// milliseconds. A missing or empty field means no producer time; an unreadable value is an
// error (the message is refused).
func ProducerTimeFromMetadata(field string) ProducerTimeFunc {
	return func(msg *message.Message) (time.Time, bool, error) {
		v := msg.Metadata.Get(field)
		if v == "" {
			return time.Time{}, false, nil
		}
		if ms, err := strconv.ParseInt(v, 10, 64); err == nil {
			return time.UnixMilli(ms), true, nil
		}
		t, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			return time.Time{}, false, fmt.Errorf("inbox: producer time in metadata %q is neither RFC 3339 nor Unix milliseconds (%d bytes)", field, len(v))
		}
		return t, true, nil
	}
}

// TooOldGuard refuses messages whose producer time says their inbox evidence may already be
// purged (older than the retention window), or that claim to come from the future. It runs
// before the claim, so it counts no attempt and writes nothing but the dead-letter record.
type TooOldGuard struct {
	// ProducerTime reads a message's producer time (ProducerTimeFromUUIDv7,
	// ProducerTimeFromMetadata). Nil turns the guard off.
	ProducerTime ProducerTimeFunc
	// Window is the age past which a message is too old. Zero: the Store's retention window
	// (pgstore.Config.Retention; with Stores, the shortest of their windows); with neither,
	// New refuses a guard with a ProducerTime.
	Window time.Duration
	// ProcessTooOld processes a too-old message anyway, logging a warning, instead of
	// dead-lettering it with the reason ReasonTooOld (the default).
	ProcessTooOld bool
	// MaxClockSkew is how far in the future a producer time may lie. Default:
	// DefaultMaxClockSkew. A message further ahead is refused (ReasonFutureProducerTime),
	// whatever ProcessTooOld says.
	MaxClockSkew time.Duration
	// Now is the clock the producer time is compared with. Default: time.Now.
	Now func() time.Time
}

func (g *TooOldGuard) setDefaults(window time.Duration) {
	*g = g.WithDefaults(window)
}

// WithDefaults returns g with its zero fields filled: Window from retentionWindow (the
// window of the table the guard protects, zero when none is configured), MaxClockSkew
// DefaultMaxClockSkew, Now time.Now. A guard without ProducerTime is returned unchanged (it is
// off). The immediate inbox fills Window from its Store's retention window; the
// store-then-process inbox (package deferred) from its Config.Retention.
func (g TooOldGuard) WithDefaults(retentionWindow time.Duration) TooOldGuard {
	if g.ProducerTime == nil {
		return g
	}
	if g.Window == 0 {
		g.Window = retentionWindow
	}
	if g.MaxClockSkew == 0 {
		g.MaxClockSkew = DefaultMaxClockSkew
	}
	if g.Now == nil {
		g.Now = time.Now
	}
	return g
}

// Validate returns an error wrapping ErrInvalidConfig for a guard with a ProducerTime and a
// negative duration, or without a window (neither Window nor a retention window on the table
// it protects). A guard without ProducerTime is off and always valid. Call it after
// WithDefaults.
func (g TooOldGuard) Validate() error {
	if g.ProducerTime == nil {
		return nil
	}
	if g.Window < 0 || g.MaxClockSkew < 0 {
		return fmt.Errorf("%w: TooOld: durations must not be negative", ErrInvalidConfig)
	}
	if g.Window == 0 {
		return fmt.Errorf("%w: TooOld: no retention window: set TooOld.Window, or a retention window on the table (pgstore.Config.Retention, deferred.Config.Retention)", ErrInvalidConfig)
	}
	return nil
}

// Check applies the guard to msg (call WithDefaults first). It returns "" and nil when msg may
// go on: the guard is off, msg carries no producer time, msg was republished by
// ReplayDeadLetter (DeadLetterReplayedKey), its producer time is inside the window, or it is
// too old and ProcessTooOld is set (a warning is then logged on logger, which may be nil).
// Otherwise it returns the dead-letter reason and a Permanent error: ReasonFutureProducerTime
// with ErrFutureProducerTime (a producer time more than MaxClockSkew ahead of Now, whatever
// ProcessTooOld says), ReasonTooOld with ErrTooOld (older than Window), or "unreadable producer
// time: ..." with the ProducerTimeFunc's error. Logs carry the message UUID (SafeMessageID),
// never the payload.
func (g TooOldGuard) Check(msg *message.Message, logger watermill.LoggerAdapter) (reason string, err error) {
	if g.ProducerTime == nil || msg.Metadata.Get(DeadLetterReplayedKey) != "" {
		return "", nil
	}
	pt, ok, err := g.ProducerTime(msg)
	if err != nil {
		return "unreadable producer time: " + err.Error(), Permanent(err)
	}
	if !ok {
		return "", nil
	}
	now := g.Now()
	switch age := now.Sub(pt); {
	case -age > g.MaxClockSkew:
		return ReasonFutureProducerTime, Permanent(fmt.Errorf("%w: producer time %s is %s ahead (limit %s)",
			ErrFutureProducerTime, pt.UTC().Format(time.RFC3339Nano), (-age).Round(time.Millisecond), g.MaxClockSkew))
	case age > g.Window:
		if g.ProcessTooOld {
			if logger != nil {
				logger.Info("WARNING: processing a message older than the retention window (TooOld.ProcessTooOld): "+
					"its inbox row may have been purged, so a duplicate of it is not detected", watermill.LogFields{
					"message_uuid": safeUUID(msg.UUID), "producer_time": pt.UTC().Format(time.RFC3339Nano),
					"age": age.Round(time.Second).String(), "retention_window": g.Window.String()})
			}
			return "", nil
		}
		return ReasonTooOld, Permanent(fmt.Errorf("%w: producer time %s, age %s, window %s",
			ErrTooOld, pt.UTC().Format(time.RFC3339Nano), age.Round(time.Second), g.Window))
	}
	return "", nil
}

// checkProducerTime applies the TooOldGuard before the claim: it returns the failure of a
// refused message (permanent, with d.res.Reason set, so it is dead-lettered without an
// attempt), or nil to go on. A message republished by ReplayDeadLetter is let through.
func (i *Inbox) checkProducerTime(d *delivery) *failure {
	reason, err := i.cfg.TooOld.Check(d.msg, i.logger)
	if err == nil {
		return nil
	}
	d.res.Reason = reason
	return &failure{kind: failMessage, err: err}
}
