package storetest_test

import (
	"testing"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
	"github.com/watermill-inbox/watermill-inbox/middleware/storetest"
)

// TestMemStoreConformance runs the conformance suite on the in-memory reference store, so
// the suite proves itself without a database.
func TestMemStoreConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) inbox.Store { return storetest.NewMemStore() })
}
