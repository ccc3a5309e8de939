package router

import (
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// batchFromEnv reads INBOX_BATCH_SIZE (deliveries per transaction; unset, 0 or 1: off) and
// INBOX_BATCH_LINGER (a Go duration, e.g. 2ms) into cfg.Batch. Errors wrap
// inbox.ErrInvalidConfig and name the variable.
func batchFromEnv(cfg *Config) error {
	if v := os.Getenv("INBOX_BATCH_SIZE"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n > inbox.MaxBatchSize {
			return fmt.Errorf("%w: router: INBOX_BATCH_SIZE=%q: want a whole number from 0 to %d", inbox.ErrInvalidConfig, v, inbox.MaxBatchSize)
		}
		cfg.Batch.Size = n
	}
	if v := os.Getenv("INBOX_BATCH_LINGER"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			return fmt.Errorf("%w: router: INBOX_BATCH_LINGER=%q: want a duration such as 2ms", inbox.ErrInvalidConfig, v)
		}
		cfg.Batch.Linger = d
	}
	return nil
}
