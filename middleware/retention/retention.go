// Package retention runs the inbox's purge in the background, beside the router: every
// Interval it deletes what has left the retention window from the inbox table, its attempts
// table and the watermill-sql topic tables you name (pgstore.Store.PurgeExpired), or from a
// store-then-process table (deferred.Inbox.PurgeExpired: done rows only), in bounded
// batches, with exactly one purger at a time across every instance.
//
//	store, _ := pgstore.New(pool, pgstore.Config{Retention: inbox.Retention{
//		Window:        14 * 24 * time.Hour, // kept this long...
//		MaxRedelivery: 7 * 24 * time.Hour,  // ...because a copy can arrive this late (+ Margin)
//	}})
//	purger, _ := retention.New(store, retention.Config{
//		Topics: []pgstore.WatermillTopic{{Topic: outbox.DefaultTopic}},
//	}, logger)
//	go func() { _ = purger.Run(ctx) }()
//	defer purger.Close()
//
// The store-then-process inbox is purged the same way (its Config.Retention sets the window):
//
//	ib, _ := deferred.New(deferred.Config{Pool: pool, ConsumerName: "billing",
//		Retention: inbox.Retention{Window: 14 * 24 * time.Hour}}, logger)
//	purger, _ := retention.New(ib, retention.Config{}, logger)
//
// The window, and how to choose it, is explained in docs/retention.md.
package retention

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/pgstore"
)

// DefaultInterval is the time between two purge passes when Config.Interval is zero.
const DefaultInterval = 10 * time.Minute

// Config configures a Purger. Zero values take the defaults documented on each field.
type Config struct {
	// Interval is the time from the end of one purge pass to the start of the next.
	// Default: DefaultInterval.
	Interval time.Duration
	// BatchSize bounds the rows deleted per transaction. Default:
	// pgstore.DefaultPurgeBatchSize (5,000).
	BatchSize int
	// Pause is slept between two batches. Default: pgstore.DefaultPurgePause.
	Pause time.Duration
	// Topics are watermill-sql topics (the outbox's, the postgres broker's) purged too.
	Topics []pgstore.WatermillTopic
	// OnPass, when set, is called after every pass with its report and error
	// (pgstore.ErrPurgeInProgress when another instance purged instead): a hook for metrics.
	OnPass func(pgstore.PurgeReport, error)
}

// Validate returns an error wrapping inbox.ErrInvalidConfig for a negative Interval,
// BatchSize or Pause.
func (c Config) Validate() error {
	if c.Interval < 0 || c.BatchSize < 0 || c.Pause < 0 {
		return fmt.Errorf("%w: retention: Interval, BatchSize and Pause must not be negative", inbox.ErrInvalidConfig)
	}
	return nil
}

// Target is what a Purger purges: a *pgstore.Store (the immediate inbox's table, its attempts
// table, and Config.Topics) or a *deferred.Inbox (the done rows of one consumer of a
// store-then-process table, and Config.Topics). Both return pgstore.ErrPurgeInProgress when
// another purger holds the target's purge lock.
type Target interface {
	// Retention returns the target's retention setting, and false when none is configured.
	Retention() (inbox.Retention, bool)
	// PurgeExpired runs one purge pass (see pgstore.Store.PurgeExpired).
	PurgeExpired(ctx context.Context, p pgstore.PurgeExpiredParams) (pgstore.PurgeReport, error)
	// Table returns the quoted, schema-qualified table name, for logs.
	Table() string
}

// Purger is the background purge of one inbox table. Run it beside the router; Close stops it.
type Purger struct {
	store  Target
	cfg    Config
	logger watermill.LoggerAdapter

	mu      sync.Mutex
	cancel  context.CancelFunc
	closed  bool
	done    chan struct{}
	running chan struct{}
}

// New returns a Purger of store's tables (a *pgstore.Store or a *deferred.Inbox), or an error
// wrapping inbox.ErrInvalidConfig for a nil store, a store without a retention window
// (pgstore.Config.Retention, deferred.Config.Retention; the purge never guesses one), or an
// invalid Config. A nil logger discards logs.
func New(store Target, cfg Config, logger watermill.LoggerAdapter) (*Purger, error) {
	if store == nil || reflect.ValueOf(store).Kind() == reflect.Pointer && reflect.ValueOf(store).IsNil() {
		return nil, fmt.Errorf("%w: retention: nil store", inbox.ErrInvalidConfig)
	}
	if _, ok := store.Retention(); !ok {
		return nil, pgstore.ErrNoRetention
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Interval == 0 {
		cfg.Interval = DefaultInterval
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Purger{store: store, cfg: cfg, logger: logger.With(watermill.LogFields{"table": store.Table()}),
		done: make(chan struct{}), running: make(chan struct{})}, nil
}

// PurgeOnce runs one purge pass now (see pgstore.Store.PurgeExpired), and returns
// pgstore.ErrPurgeInProgress when another purger holds the table's purge lock.
func (p *Purger) PurgeOnce(ctx context.Context) (pgstore.PurgeReport, error) {
	return p.store.PurgeExpired(ctx, pgstore.PurgeExpiredParams{BatchSize: p.cfg.BatchSize, Pause: p.cfg.Pause, Topics: p.cfg.Topics})
}

// Running is closed once Run has started.
func (p *Purger) Running() <-chan struct{} { return p.running }

// Run purges at once, then every Interval, until ctx ends or Close is called; it then returns
// nil. A pass that fails is logged at ERROR and retried at the next interval; a pass skipped
// because another instance is purging is logged at DEBUG. Run may be called once; a second
// call returns an error.
func (p *Purger) Run(ctx context.Context) error {
	p.mu.Lock()
	if p.closed || p.cancel != nil {
		p.mu.Unlock()
		return errors.New("retention: Run called twice, or after Close")
	}
	ctx, p.cancel = context.WithCancel(ctx)
	p.mu.Unlock()
	defer close(p.done)
	close(p.running)
	for {
		start := time.Now()
		rep, err := p.PurgeOnce(ctx)
		switch {
		case ctx.Err() != nil:
			return nil
		case errors.Is(err, pgstore.ErrPurgeInProgress):
			p.logger.Debug("Purge skipped: another purger is running", nil)
		case err != nil:
			p.logger.Error("Purge failed; retrying at the next interval", err, watermill.LogFields{"rows": rep.Rows()})
		default:
			fields := watermill.LogFields{"rows": rep.Rows(), "cutoff": rep.Cutoff.UTC().Format(time.RFC3339), "took": time.Since(start).Round(time.Millisecond).String()}
			for _, t := range rep.Tables {
				fields[t.Kind+":"+t.Table] = t.Rows
			}
			p.logger.Info("Purge pass done", fields)
		}
		if p.cfg.OnPass != nil {
			p.cfg.OnPass(rep, err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(p.cfg.Interval):
		}
	}
}

// Close stops Run (a batch in progress is cancelled and rolls back) and waits for it to
// return. It is safe to call more than once, and before Run (Run then returns at once).
func (p *Purger) Close() error {
	p.mu.Lock()
	p.closed = true
	cancel := p.cancel
	p.mu.Unlock()
	if cancel == nil {
		return nil
	}
	cancel()
	<-p.done
	return nil
}
