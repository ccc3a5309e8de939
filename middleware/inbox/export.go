package inbox

// SafeMessageID returns a message UUID or key as it may appear in logs and error strings: a
// placeholder naming its length when it is not key material (invalid UTF-8, NUL, over
// MaxKeyBytes), quoted with Go escapes when it holds a control character (which could forge
// log lines), else unchanged. Other inbox modes (package middleware/deferred) log through it.
func SafeMessageID(id string) string { return safeUUID(id) }

// ValidText reports whether s may be stored as optional text beside a message (a message
// type, a correlation ID, an aggregate key): what ValidateKey accepts. Other inbox modes use
// it to drop unstorable optional metadata.
func ValidText(s string) bool { return validOrEmpty(s) != "" }
