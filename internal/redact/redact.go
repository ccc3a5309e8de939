// Package redact keeps secrets, payloads and hostile text out of what the project logs and
// returns as errors: URLs with their password replaced (as pgx and net/url do), a Watermill
// logger that drops the fields in which Watermill's components put message contents, and a
// quoting of strings that carry control characters.
package redact

import (
	"context"
	"errors"
	"net/url"
	"strconv"
	"strings"
	"unicode"

	"github.com/ThreeDotsLabs/watermill"
)

// URL returns raw with the password of its userinfo replaced by "xxxxx" (net/url's
// URL.Redacted, the same mask pgx uses); the user name is kept. A URL without a scheme
// ("user:secret@host:port", a Kafka seed broker) is parsed as if it had one; one that does
// not parse (a bad port) has what stands between "://" and its last '@' masked after the
// first ':'. A string without '@' is returned as it is.
func URL(raw string) string {
	if !strings.Contains(raw, "@") {
		return raw
	}
	u, err := url.Parse(raw)
	if err == nil && u.Scheme != "" && u.Host != "" {
		return u.Redacted()
	}
	// host:port with userinfo and no scheme, e.g. "user:secret@broker:9092".
	if v, err := url.Parse("x://" + raw); err == nil && v.User != nil {
		return strings.TrimPrefix(v.Redacted(), "x://")
	}
	// Unparseable (a bad port, say): mask by hand what stands between the scheme and the
	// last '@'.
	start := 0
	if i := strings.Index(raw, "://"); i >= 0 {
		start = i + 3
	}
	at := strings.LastIndex(raw, "@")
	if at < start {
		return "<unparseable URL>"
	}
	user, _, hasPassword := strings.Cut(raw[start:at], ":")
	if !hasPassword {
		return raw
	}
	return raw[:start] + user + ":xxxxx" + raw[at:]
}

// URLsIn returns s with each of urls replaced by URL(u), and the password of each (which a
// client library may print on its own, or inside a differently formatted URL) replaced by
// "xxxxx": for error strings of client libraries that echo the URL they were given.
func URLsIn(s string, urls ...string) string {
	for _, u := range urls {
		if u == "" {
			continue
		}
		if r := URL(u); r != u {
			s = strings.ReplaceAll(s, u, r)
		}
		// A library may print the URL's userinfo without the scheme, or the password alone.
		if p, err := url.Parse(u); err == nil && p.User != nil {
			if pw, ok := p.User.Password(); ok && pw != "" {
				s = strings.ReplaceAll(s, pw, "xxxxx")
			}
		} else if i := strings.LastIndex(u, "@"); i > 0 {
			if j := strings.Index(u[:i], ":"); j >= 0 && !strings.Contains(u[:i], "/") {
				if pw := u[j+1 : i]; pw != "" {
					s = strings.ReplaceAll(s, pw, "xxxxx")
				}
			}
		}
	}
	return s
}

// Error is an error whose text has the passwords of urls masked (URLsIn), wrapping the
// original so errors.Is and errors.As still see it.
type Error struct {
	text string
	err  error
}

func (e *Error) Error() string { return e.text }
func (e *Error) Unwrap() error { return e.err }

// Err returns err with every password of urls masked in its text (nil for nil).
func Err(err error, urls ...string) error {
	if err == nil {
		return nil
	}
	t := URLsIn(err.Error(), urls...)
	if t == err.Error() {
		return err
	}
	return &Error{text: t, err: err}
}

// String returns s for a log field or an error string: as it is, or quoted with Go escapes
// (strconv.Quote) when it holds a control character (a newline, a carriage return, an
// escape sequence), so that it cannot end a log line and forge another.
func String(s string) string {
	if strings.IndexFunc(s, unicode.IsControl) >= 0 {
		return strconv.Quote(s)
	}
	return s
}

// Fields are the log fields in which Watermill's components put message contents:
// components/forwarder logs "payload" and "metadata" when it cannot unwrap an envelope, and
// watermill-sql logs the SQL arguments, payloads and metadata included, as "query_args" (at
// trace level).
var Fields = map[string]bool{"payload": true, "metadata": true, "query_args": true}

// Logger wraps a Watermill logger so that no line carries Fields' values (each is replaced
// by "<redacted>"), and string values with control characters are quoted (String). An error
// caused by a cancelled context is logged at INFO: a graceful stop cancels watermill-sql's
// poll in flight ("could not commit tx for querying message: context canceled"), which is
// harmless. The passwords of urls (broker URLs a component may print) are masked in every
// message, string field and error (URLsIn). A nil l discards logs.
func Logger(l watermill.LoggerAdapter, urls ...string) watermill.LoggerAdapter {
	if l == nil {
		return watermill.NopLogger{}
	}
	if r, ok := l.(logger); ok {
		if len(urls) == 0 {
			return l
		}
		l = r.l
		urls = append(append([]string(nil), r.urls...), urls...)
	}
	return logger{l: l, urls: urls, stopAsInfo: true}
}

// Escape wraps a Watermill logger so that string field values, and the error's text, with
// control characters are quoted (String): no value can end a log line and forge another,
// whatever the backend. Unlike Logger it changes no level. A nil l discards logs.
func Escape(l watermill.LoggerAdapter) watermill.LoggerAdapter {
	if l == nil {
		return watermill.NopLogger{}
	}
	if _, ok := l.(logger); ok {
		return l
	}
	return logger{l: l}
}

type logger struct {
	l          watermill.LoggerAdapter
	urls       []string
	stopAsInfo bool // an error caused by context.Canceled is logged at INFO
}

// escapedError is an error whose text was quoted or masked, wrapping the original.
func (r logger) err(err error) error {
	if err == nil {
		return nil
	}
	err = Err(err, r.urls...)
	if t := err.Error(); String(t) != t {
		return &Error{text: String(t), err: err}
	}
	return err
}

// clean is Clean with the logger's URLs masked in string and error values.
func (r logger) clean(fields watermill.LogFields) watermill.LogFields {
	fields = Clean(fields)
	if len(r.urls) == 0 {
		return fields
	}
	out := make(watermill.LogFields, len(fields))
	for k, v := range fields {
		switch x := v.(type) {
		case string:
			v = URLsIn(x, r.urls...)
		case error:
			v = String(URLsIn(x.Error(), r.urls...))
		}
		out[k] = v
	}
	return out
}

func (r logger) msg(m string) string { return String(URLsIn(m, r.urls...)) }

// Clean returns fields with Fields' values replaced by "<redacted>" and string values with
// control characters quoted; fields itself is never modified.
func Clean(fields watermill.LogFields) watermill.LogFields {
	dirty := false
	for k, v := range fields {
		if Fields[k] {
			dirty = true
			break
		}
		if s, ok := text(v); ok && String(s) != s {
			dirty = true
			break
		}
	}
	if !dirty {
		return fields
	}
	out := make(watermill.LogFields, len(fields))
	for k, v := range fields {
		switch {
		case Fields[k]:
			v = "<redacted>"
		default:
			if s, ok := text(v); ok && String(s) != s {
				v = String(s)
			}
		}
		out[k] = v
	}
	return out
}

// text returns a field value's text when it is a string or an error.
func text(v any) (string, bool) {
	switch x := v.(type) {
	case string:
		return x, true
	case error:
		return x.Error(), true
	}
	return "", false
}

func (r logger) Error(msg string, err error, fields watermill.LogFields) {
	if r.stopAsInfo && errors.Is(err, context.Canceled) {
		r.l.Info(r.msg(msg)+" (stopping)", r.clean(fields).Add(watermill.LogFields{"error": String(URLsIn(err.Error(), r.urls...))}))
		return
	}
	r.l.Error(r.msg(msg), r.err(err), r.clean(fields))
}
func (r logger) Info(msg string, fields watermill.LogFields)  { r.l.Info(r.msg(msg), r.clean(fields)) }
func (r logger) Debug(msg string, fields watermill.LogFields) { r.l.Debug(r.msg(msg), r.clean(fields)) }
func (r logger) Trace(msg string, fields watermill.LogFields) { r.l.Trace(r.msg(msg), r.clean(fields)) }
func (r logger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return logger{l: r.l.With(r.clean(fields)), urls: r.urls, stopAsInfo: r.stopAsInfo}
}
