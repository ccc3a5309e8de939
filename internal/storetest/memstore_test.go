package storetest_test

import (
	"testing"

	"github.com/watermill-inbox/watermill-inbox/internal/contract"
	"github.com/watermill-inbox/watermill-inbox/internal/storetest"
)

// TestMemStoreConformance runs the conformance suite on the in-memory reference store, so
// the suite proves itself without a database.
func TestMemStoreConformance(t *testing.T) {
	storetest.Run(t, storetest.Harness{
		New: func(t *testing.T) contract.Store { return storetest.NewMemStore() },
		Record: func(t *testing.T, s contract.Store, k contract.Key) (int, bool) {
			r, ok := s.(*storetest.MemStore).Records()[k]
			return r.Attempts, ok
		},
	})
}
