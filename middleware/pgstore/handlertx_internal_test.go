package pgstore

import "testing"

// TestTxControlStatements: the statements handlerTx refuses before they are sent, and the ones
// it lets through, whatever their case, leading white space and comments.
func TestTxControlStatements(t *testing.T) {
	for sql, want := range map[string]bool{
		"commit": true, "  COMMIT;": true, "/* c */ commit work": true, "-- c\nrollback": true,
		"ROLLBACK": true, "abort": true, "end": true, "begin": true, "START TRANSACTION": true,
		"prepare transaction 'x'": true, "commit prepared 'x'": true, "rollback prepared 'x'": true,
		"ROLLBACK TO SAVEPOINT sp": false, "rollback to sp": false, "savepoint sp": false,
		"release savepoint sp": false, "prepare q as select 1": false, "select 'commit'": false,
		"commitx": false, "UPDATE accounts SET balance = 1": false, "": false, "-- only a comment": false,
	} {
		if got := txControl(sql); got != want {
			t.Errorf("txControl(%q) = %v, want %v", sql, got, want)
		}
	}
}
