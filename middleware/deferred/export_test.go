package deferred

func (i *Inbox) ClaimSQLForTest() string { return i.n.claimSQL }
