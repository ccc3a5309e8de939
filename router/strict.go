package router

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"sort"
	"strings"

	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// envNames are the environment variables ConfigFromEnv reads (INBOX_CONSUMER_GROUP is read
// only to be refused).
var envNames = []string{
	"INBOX_BROKER", "INBOX_BROKER_URL", "INBOX_AMQP_URL", "INBOX_NATS_URL", "INBOX_REDIS_URL",
	"INBOX_CONSUMER_GROUP_PREFIX", "INBOX_CONSUMER_GROUP", "INBOX_MODE", envSQSQueryProtocol,
	"INBOX_BATCH_SIZE", "INBOX_BATCH_LINGER",
}

// envPrefixes are the name spaces the router owns: a variable starting with one of them that
// is not in envNames is a misspelling (INBOX_BROKER_URI, INBOX_BATCH_SIZ, INBOX_MODES).
var envPrefixes = []string{"INBOX_BROKER", "INBOX_BATCH_", "INBOX_CONSUMER_GROUP", "INBOX_MODE", "INBOX_SQS_QUERY"}

// checkEnv refuses an environment (os.Environ's "NAME=value" entries) that says two things or
// something unread: a variable of envNames given twice (programs disagree on which one
// counts), one whose name differs from one of envNames only in case (inbox_broker), or an
// unknown name in a name space the router owns (envPrefixes). The error names the variable.
func checkEnv(environ []string) error {
	seen := map[string]bool{}
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		known := false
		for _, k := range envNames {
			switch {
			case name == k:
				known = true
				if seen[name] {
					return fmt.Errorf("%w: router: %s is set twice in the environment", inbox.ErrInvalidConfig, name)
				}
				seen[name] = true
			case strings.EqualFold(name, k):
				return fmt.Errorf("%w: router: environment variable %s differs from %s only in case", inbox.ErrInvalidConfig, name, k)
			}
		}
		if known {
			continue
		}
		for _, p := range envPrefixes {
			if strings.HasPrefix(strings.ToUpper(name), p) {
				return fmt.Errorf("%w: router: environment variable %s is not read (known: %s)", inbox.ErrInvalidConfig, name, strings.Join(envNames, ", "))
			}
		}
	}
	return nil
}

// jsonFields returns the JSON names of v's struct fields (their json tags; "-" left out).
func jsonFields(v any) []string {
	t := reflect.TypeOf(v)
	var out []string
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if f.IsExported() && name != "" && name != "-" {
			out = append(out, name)
		}
	}
	sort.Strings(out)
	return out
}

// decodeStrictJSON decodes raw, one JSON object, into v (a pointer to a struct of scalar
// fields), refusing what encoding/json would accept but a reader could take otherwise: a key
// given twice (encoding/json keeps the last), a key that matches a field only when case is
// ignored (encoding/json matches case-insensitively), an unknown key, and anything but white
// space after the object (encoding/json's Decoder stops after the first value). Errors name
// the key; "at offset" is the byte offset in raw.
func decodeStrictJSON(raw []byte, v any) error {
	fields := jsonFields(reflect.ValueOf(v).Elem().Interface())
	dec := json.NewDecoder(bytes.NewReader(raw))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return errors.New("want one JSON object")
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		key, _ := tok.(string)
		if err := checkKey(key, fields, seen); err != nil {
			return err
		}
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return fmt.Errorf("field %q: %w", key, err)
		}
	}
	if _, err := dec.Token(); err != nil { // the closing '}'
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return fmt.Errorf("trailing data after the JSON object at offset %d", dec.InputOffset())
	}
	strict := json.NewDecoder(bytes.NewReader(raw))
	strict.DisallowUnknownFields()
	return strict.Decode(v)
}

// checkKey refuses a duplicate key, a key that is a field only ignoring case, and an unknown
// key.
func checkKey(key string, fields []string, seen map[string]bool) error {
	if seen[key] {
		return fmt.Errorf("field %q given twice", key)
	}
	seen[key] = true
	for _, f := range fields {
		if key == f {
			return nil
		}
	}
	for _, f := range fields {
		if strings.EqualFold(key, f) {
			return fmt.Errorf("field %q differs from %q only in case", key, f)
		}
	}
	return fmt.Errorf("unknown field %q (known: %s)", key, strings.Join(fields, ", "))
}
