package redact_test

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"

	"github.com/watermill-inbox/watermill-inbox/internal/redact"
)

// connForms are the connection-string forms a user may give: URLs (userinfo, encoded
// password, bad port, each secret query key in any case or percent-encoded), a string that
// does not parse as a URL, userinfo without a scheme, keyword/value DSNs (bare, quoted with
// spaces and escapes, spaces around '=', sslpassword beside a key path). Each hides "S3cr3t".
var connForms = []struct{ raw, secret string }{
	{"postgres://app:S3cr3t@127.0.0.1:5432/test", "S3cr3t"},
	{"postgresql://app:S3cr3t@127.0.0.1:badport/test", "S3cr3t"},
	{"postgres://app:S3cr3t%2F%40x@127.0.0.1/test", "S3cr3t/@x"},
	{"postgres://app@127.0.0.1/test?password=S3cr3t", "S3cr3t"},
	{"postgres://app@127.0.0.1/test?sslmode=require&sslpassword=S3cr3t", "S3cr3t"},
	{"postgres://app@127.0.0.1/test?PASSWORD=S3cr3t", "S3cr3t"},
	{"postgres://app@127.0.0.1/test?pass%77ord=S3cr3t", "S3cr3t"},
	{"postgres://app@127.0.0.1/test?sslPassword=S3cr3t&password=S3cr3t", "S3cr3t"},
	{"postgres:app:S3cr3t@127.0.0.1/test", "S3cr3t"},
	{"app:S3cr3t@127.0.0.1:5432/test", "S3cr3t"},
	{"postgres://app:S3cr3t@127.0.0.1:5432/te st%zz", "S3cr3t"},
	{"host=127.0.0.1 user=app password=S3cr3t dbname=test", "S3cr3t"},
	{"host=127.0.0.1 user=app password='S3cr3t with spaces' dbname=test", "S3cr3t with spaces"},
	{`host=127.0.0.1 password='it\'s S3cr3t'`, "it's S3cr3t"},
	{"host=127.0.0.1 password = S3cr3t dbname=test", "S3cr3t"},
	{"host=127.0.0.1 PassWord=S3cr3t", "S3cr3t"},
	{"host=127.0.0.1 password=S3cr3t&more user=app", "S3cr3t&more"},
	{"host=127.0.0.1 sslkey=/etc/app/key.pem sslpassword=S3cr3t sslmode=nonsense", "S3cr3t"},
}

// TestConnStringMasksEveryForm: ConnString, Conn on a text that echoes the string (or only
// its secret, plain or percent-encoded), and ConnErr never leave the secret, and keep the
// user and host where the string is readable.
func TestConnStringMasksEveryForm(t *testing.T) {
	for _, f := range connForms {
		raw := f.raw
		got := redact.ConnString(raw)
		if strings.Contains(got, "S3cr3t") {
			t.Errorf("ConnString(%q) = %q", raw, got)
		}
		if u, err := url.Parse(raw); err == nil && u.Host != "" && u.User != nil && !strings.Contains(got, "app@127.0.0.1") && !strings.Contains(got, "app:xxxxx@127.0.0.1") {
			t.Errorf("ConnString(%q) = %q: the user or host is lost", raw, got)
		}
		for _, text := range []string{
			"connect to " + raw + ": refused",
			"cannot parse `" + raw + "`: failed",
			"bad password " + f.secret,
			"encoded " + url.QueryEscape(f.secret) + " " + url.PathEscape(f.secret),
		} {
			if got := redact.Conn(text, raw); strings.Contains(got, "S3cr3t") {
				t.Errorf("Conn(%q, %q) = %q", text, raw, got)
			}
		}
		base := errors.New("root")
		err := redact.ConnErr(fmt.Errorf("open %s: %w", raw, base), raw)
		if strings.Contains(err.Error(), "S3cr3t") || !errors.Is(err, base) {
			t.Errorf("ConnErr: %v (wraps the cause: %v)", err, errors.Is(err, base))
		}
	}
	if got := redact.ConnString("host=127.0.0.1 sslkey=/etc/app/key.pem"); got != "host=127.0.0.1 sslkey=/etc/app/key.pem" {
		t.Errorf("a DSN without a secret changed: %q", got)
	}
	if got := redact.ConnString("postgres://app@127.0.0.1:5432/test?sslmode=disable"); got != "postgres://app@127.0.0.1:5432/test?sslmode=disable" {
		t.Errorf("a URL without a secret changed: %q", got)
	}
}

// TestConnMasksTheEnvironment: a secret that comes from PGPASSWORD or PGSSLPASSWORD (the
// connection string has none) is masked too, as is a DSN or URL secret a library echoes in
// a text the caller did not name.
func TestConnMasksTheEnvironment(t *testing.T) {
	for _, env := range redact.SecretEnv {
		t.Run(env, func(t *testing.T) {
			t.Setenv(env, "EnvS3cr3t")
			if got := redact.Conn("auth failed with EnvS3cr3t", "postgres://app@127.0.0.1/test"); strings.Contains(got, "EnvS3cr3t") {
				t.Errorf("Conn = %q", got)
			}
		})
	}
	for _, text := range []string{"dsn password=S3cr3t host=h", "dsn sslpassword='a S3cr3t'", "url redis://u:S3cr3t@h:1/0", "q ?x=1&password=S3cr3t"} {
		if got := redact.Conn(text); strings.Contains(got, "S3cr3t") {
			t.Errorf("Conn(%q) = %q", text, got)
		}
	}
}
