package deferred

// ClaimSQL exposes the claim statement to the tests (TestClaimPlanByPrimaryKey).
func ClaimSQL(i *Inbox) string { return i.n.claimSQL }

// SetRowLimits lowers the limits of what one row holds (bytes) for a test and returns the
// function that restores them.
func SetRowLimits(row, metadata int) (restore func()) {
	oldRow, oldMeta := maxRowBytes, maxMetadataBytes
	maxRowBytes, maxMetadataBytes = row, metadata
	return func() { maxRowBytes, maxMetadataBytes = oldRow, oldMeta }
}
