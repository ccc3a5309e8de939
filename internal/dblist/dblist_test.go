package dblist

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLabel(t *testing.T) {
	t.Setenv("PGHOST", "")
	t.Setenv("PGPORT", "")
	t.Setenv("PGDATABASE", "")
	for conn, want := range map[string]string{
		"postgres://app:Hunter2pw@db1.internal:6432/billing?sslmode=disable":  "db1.internal:6432/billing",
		"postgresql://app@db1.internal/billing":                               "db1.internal:5432/billing",
		"postgres://app:Hunter2pw@[::1]:5433/t":                               "[::1]:5433/t",
		"postgres://app@h1:5432,h2:5433/shard_2?sslmode=prefer":               "h1:5432,h2:5433/shard_2",
		"host=10.0.0.7 port=5434 dbname=tenant_a user=app password=Hunter2pw": "10.0.0.7:5434/tenant_a",
		"postgres://app@127.0.0.1:5432/a%0Ab":                                 `"127.0.0.1:5432/a\nb"`,
	} {
		got, ok := Label(conn)
		if !ok || got != want {
			t.Errorf("Label(%q) = %q, %v; want %q", conn, got, ok, want)
		}
	}
	// Strings pgx cannot read, and a database name that is the password: no label.
	for _, conn := range []string{
		"postgres://app:Hunter2pw@127.0.0.1:badport/test",
		"postgres://app:Hunter2pw@[::1/test",
		"app:Hunter2pw@127.0.0.1:1/test",
		"host=127.0.0.1 port=badport password=Hunter2pw",
		"postgres://app:Hunter2pw@127.0.0.1/Hunter2pw",
	} {
		if got, ok := Label(conn); ok || strings.Contains(got, "Hunter2pw") {
			t.Errorf("Label(%q) = %q, %v; want no label", conn, got, ok)
		}
	}
}

func TestRead(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "databases")
	content := "# tenants\n\n  postgres://app:Hunter2pw@h:5432/tenant_b  \n\t# postgres://app@h/old\npostgres://app:Hunter2pw@h:badport/x\n"
	if err := os.WriteFile(file, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	dbs, err := Read([]string{"postgres://app@h/tenant_a"}, file)
	if err != nil {
		t.Fatal(err)
	}
	want := []Database{
		{URL: "postgres://app@h/tenant_a", Label: "h:5432/tenant_a"},
		{URL: "postgres://app:Hunter2pw@h:5432/tenant_b", Label: "h:5432/tenant_b"},
		{URL: "postgres://app:Hunter2pw@h:badport/x", Label: "database 3"},
	}
	if len(dbs) != len(want) {
		t.Fatalf("Read = %+v, want %+v", dbs, want)
	}
	for i := range want {
		if dbs[i] != want[i] {
			t.Errorf("entry %d = %+v, want %+v", i, dbs[i], want[i])
		}
	}

	// The same database twice (another user, the port written out): refused.
	if _, err := Read([]string{"postgres://other@h:5432/tenant_b"}, file); !errors.Is(err, ErrList) || !strings.Contains(err.Error(), "entries 1 and 2") {
		t.Errorf("a database named twice: %v", err)
	}
	// No file, an empty file, an overlong line: ErrList, and never a line's content.
	empty := filepath.Join(dir, "empty")
	long := filepath.Join(dir, "long")
	_ = os.WriteFile(empty, []byte("# nothing yet\n\n"), 0o600)
	_ = os.WriteFile(long, []byte("postgres://app:Hunter2pw@h/"+strings.Repeat("x", maxLine)+"\n"), 0o600)
	for _, path := range []string{filepath.Join(dir, "missing"), empty, long} {
		_, err := Read(nil, path)
		if !errors.Is(err, ErrList) || strings.Contains(err.Error(), "Hunter2pw") {
			t.Errorf("Read(%s): %v", filepath.Base(path), err)
		}
	}
}
