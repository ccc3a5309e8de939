package deferred

// ClaimSQL exposes the claim statement to the tests (TestClaimPlanByPrimaryKey).
func ClaimSQL(i *Inbox) string { return i.n.claimSQL }
