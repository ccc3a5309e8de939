package sqlstore_test

import (
	"testing"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
	"github.com/watermill-inbox/watermill-inbox/middleware/sqlstore"
)

// TestConformance runs the storage contract's conformance suite, unchanged, on each dialect,
// each case on a fresh database (MySQL) or schema (PostgreSQL).
func TestConformance(t *testing.T) {
	forEach(t, func(t *testing.T, d sqlstore.Dialect) {
		storetest.Run(t, storetest.Harness{
			New: func(t *testing.T) contract.Store {
				return track(t, newEnv(t, d, 8).store(t, sqlstore.Config{}))
			},
			Record: func(t *testing.T, s contract.Store, k contract.Key) (int, bool) {
				return attemptsRow(t, s.(*tracked).Store.(*sqlstore.Store), d, k)
			},
		})
	})
}
