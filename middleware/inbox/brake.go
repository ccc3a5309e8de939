package inbox

import (
	"fmt"
	"sync"
	"time"
)

// Defaults of InvalidKeyBrake.
const (
	// DefaultBrakeWindow is the number of recent deliveries the brake looks at.
	DefaultBrakeWindow = 50
	// DefaultBrakeShare is the share of invalid keys in the window (0 to 1) that engages it.
	DefaultBrakeShare = 0.5
	// DefaultBrakeMinInvalid is the number of invalid keys in the window below which it never
	// engages, so a few bad messages at start-up are dead-lettered as usual.
	DefaultBrakeMinInvalid = 5
	// DefaultBrakePause is how long a braked delivery waits before it is nacked, so the
	// broker's redelivery does not spin.
	DefaultBrakePause = time.Second
)

// InvalidKeyBrake stops a flood of invalid keys from being dead-lettered. The inbox remembers
// whether each of the last Window deliveries had a valid key; when an invalid one arrives
// while at least MinInvalid of them, and at least Share of them, were invalid, it is nacked
// with ErrInvalidKeyFlood after Pause instead of dead-lettered, and the inbox logs an ERROR
// (at most once per 10 seconds). A single bad message among good ones is dead-lettered as
// before. Zero fields take the Default* values; Disabled turns the brake off. The window is
// in process memory, per Inbox: each instance brakes on what it sees. With Config.Stores a
// message whose route names no store (a *RouteError) counts as an invalid key.
type InvalidKeyBrake struct {
	// Disabled turns the brake off: every invalid key is dead-lettered (with a dead-letter
	// topic) or returned as permanent.
	Disabled bool
	// Window is the number of recent deliveries considered. Default: DefaultBrakeWindow.
	Window int
	// Share is the share of invalid keys (0 to 1] in the window that engages the brake.
	// Default: DefaultBrakeShare.
	Share float64
	// MinInvalid is the number of invalid keys in the window needed to engage it. Default:
	// DefaultBrakeMinInvalid.
	MinInvalid int
	// Pause delays the nack of a braked delivery (honouring the message's context). Default:
	// DefaultBrakePause.
	Pause time.Duration
}

func (b *InvalidKeyBrake) setDefaults() {
	if b.Window == 0 {
		b.Window = DefaultBrakeWindow
	}
	if b.Share == 0 {
		b.Share = DefaultBrakeShare
	}
	if b.MinInvalid == 0 {
		b.MinInvalid = DefaultBrakeMinInvalid
	}
	if b.Pause == 0 {
		b.Pause = DefaultBrakePause
	}
}

func (b InvalidKeyBrake) validate() error {
	if b.Window < 1 || b.Share <= 0 || b.Share > 1 || b.MinInvalid < 1 || b.Pause < 0 {
		return fmt.Errorf("%w: InvalidKeyBrake wants Window >= 1, 0 < Share <= 1, MinInvalid >= 1, Pause >= 0", ErrInvalidConfig)
	}
	return nil
}

// keyWindow is the ring of the last deliveries' key validity.
type keyWindow struct {
	mu       sync.Mutex
	invalid  []bool
	next     int
	filled   int
	count    int // invalid entries in the ring
	lastWarn time.Time
}

// observe records one delivery and reports whether the brake is engaged for it (only
// invalid keys can be braked) and whether to log now.
func (w *keyWindow) observe(b InvalidKeyBrake, invalid bool) (brake, warn bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.invalid == nil {
		w.invalid = make([]bool, b.Window)
	}
	if w.filled == len(w.invalid) {
		if w.invalid[w.next] {
			w.count--
		}
	} else {
		w.filled++
	}
	w.invalid[w.next] = invalid
	if invalid {
		w.count++
	}
	w.next = (w.next + 1) % len(w.invalid)
	if !invalid || w.count < b.MinInvalid || float64(w.count) < b.Share*float64(w.filled) {
		return false, false
	}
	now := time.Now()
	if now.Sub(w.lastWarn) >= 10*time.Second {
		w.lastWarn = now
		return true, true
	}
	return true, false
}
