package redact

import (
	"net/url"
	"os"
	"regexp"
	"strings"
)

// Mask replaces every secret the package hides.
const Mask = "xxxxx"

// SecretKeys are the connection parameters whose values are secrets: the ones libpq marks for
// display as a password ("*" in fe-connect.c's PQconninfoOptions), which pgx reads too.
// sslkey, sslcert, sslrootcert and passfile name files, not secrets, and are kept.
var SecretKeys = []string{"password", "sslpassword"}

// SecretEnv are the environment variables libpq and pgx read SecretKeys from.
var SecretEnv = []string{"PGPASSWORD", "PGSSLPASSWORD"}

// hidden stands for a connection string that cannot be read well enough to mask it.
const hidden = "(connection string hidden)"

// secretKV matches a SecretKeys parameter in keyword/value or query form: the key, optional
// white space around '=', and a quoted ('...', with backslash escapes) or bare value, up to
// white space (a DSN's bare value may hold '&'; in a URL's query this masks the parameters
// after it too, which hides more than needed and never less).
var secretKV = regexp.MustCompile(`(?i)\b((?:ssl)?password)\s*=\s*(?:'(?:[^'\\]|\\.)*'?|[^\s'][^\s]*)?`)

// userinfo matches the password of a URL's userinfo in text: "scheme://user:secret@".
var userinfo = regexp.MustCompile(`(?i)\b([a-z][a-z0-9+.-]*://[^:/?#@\s]*):[^@\s]*@`)

// ConnString returns a PostgreSQL connection string (or any URL) as it may be printed: a URL
// (postgres://user:secret@host/db?sslpassword=...) keeps its user and everything else with
// the userinfo password and the values of SecretKeys in its query (keys matched after
// percent-decoding, in any case) replaced by Mask; a keyword/value DSN ("host=h
// password='a b'") has the values of SecretKeys masked; a string that is neither (no
// "://", a '@' and a ':' before it: "postgres:app:secret@h/db", "app:secret@h") is not
// printed at all, only a placeholder. A string without secret has nothing to change.
func ConnString(raw string) string {
	if u, err := url.Parse(raw); err == nil && u.Scheme != "" && u.Opaque == "" && strings.Contains(raw, "://") {
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), Mask)
		}
		if u.RawQuery != "" {
			q := u.Query()
			for k := range q {
				if isSecretKey(k) {
					q[k] = []string{Mask}
				}
			}
			u.RawQuery = q.Encode()
		}
		return strings.Replace(u.String(), url.QueryEscape(Mask), Mask, -1)
	}
	masked := secretKV.ReplaceAllString(raw, "${1}="+Mask)
	if at := strings.LastIndex(masked, "@"); at >= 0 && strings.Contains(masked[:at], ":") {
		return hidden // a URL that does not parse, or userinfo without a scheme
	}
	return masked
}

// isSecretKey reports whether a query or DSN key names a SecretKeys parameter.
func isSecretKey(k string) bool {
	for _, s := range SecretKeys {
		if strings.EqualFold(k, s) {
			return true
		}
	}
	return false
}

// Secrets returns the secret values a connection string holds, in every form ConnString
// reads, each also percent-encoded as a URL would print it: for masking them wherever a
// client library echoes them. An unreadable string gives every piece that may be a
// password (what follows each ':' before the last '@').
func Secrets(raw string) []string {
	var out []string
	add := func(s string) {
		if s != "" && s != Mask {
			out = append(out, s, url.QueryEscape(s), url.PathEscape(s))
		}
	}
	if u, err := url.Parse(raw); err == nil && u.Scheme != "" && u.Opaque == "" && strings.Contains(raw, "://") {
		if p, ok := u.User.Password(); ok {
			add(p)
		}
		for k, vs := range u.Query() {
			if isSecretKey(k) {
				for _, v := range vs {
					add(v)
				}
			}
		}
	} else if at := strings.LastIndex(raw, "@"); at >= 0 {
		before := raw[:at]
		if i := strings.LastIndex(before, "//"); i >= 0 {
			before = before[i+2:]
		}
		for i := strings.Index(before, ":"); i >= 0; i = strings.Index(before, ":") {
			before = before[i+1:]
			add(before)
		}
	}
	for _, m := range secretKV.FindAllString(raw, -1) {
		_, v, _ := strings.Cut(m, "=")
		v = strings.TrimSpace(v)
		if len(v) >= 2 && v[0] == '\'' && v[len(v)-1] == '\'' {
			add(v)
			v = strings.ReplaceAll(strings.ReplaceAll(v[1:len(v)-1], `\'`, `'`), `\\`, `\`)
		}
		add(v)
	}
	return out
}

// Conn returns s with every secret of the connection strings conns and of the environment
// (SecretEnv) masked: each of conns replaced by ConnString, each of their Secrets and each
// secret environment value replaced by Mask, then any SecretKeys value and URL userinfo
// password left in s itself. It is the one masking function of the command-line tool's
// errors.
func Conn(s string, conns ...string) string {
	for _, c := range conns {
		if c != "" {
			s = strings.ReplaceAll(s, c, ConnString(c))
		}
	}
	var secrets []string
	for _, c := range conns {
		secrets = append(secrets, Secrets(c)...)
	}
	for _, e := range SecretEnv {
		if v := os.Getenv(e); v != "" {
			secrets = append(secrets, v, url.QueryEscape(v))
		}
	}
	for _, p := range secrets {
		s = strings.ReplaceAll(s, p, Mask)
	}
	s = secretKV.ReplaceAllString(s, "${1}="+Mask)
	return userinfo.ReplaceAllString(s, "${1}:"+Mask+"@")
}

// ConnErr returns err with its text masked by Conn (nil for nil), wrapping the original so
// errors.Is and errors.As still see it.
func ConnErr(err error, conns ...string) error {
	if err == nil {
		return nil
	}
	t := Conn(err.Error(), conns...)
	if t == err.Error() {
		return err
	}
	return &Error{text: t, err: err}
}
