package inbox_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestCoreLinksNoTelemetry: the core package must not pull Prometheus or OpenTelemetry into a
// program that imports only it; they live in middleware/inboxmetrics and middleware/inboxtrace.
func TestCoreLinksNoTelemetry(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/watermill-inbox/watermill-inbox/middleware/inbox").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	deps := strings.Fields(string(out))
	if len(deps) < 10 {
		t.Fatalf("go list -deps printed %d packages; want the core's dependency list", len(deps))
	}
	for _, d := range deps {
		if strings.HasPrefix(d, "github.com/prometheus/") || strings.HasPrefix(d, "go.opentelemetry.io/") {
			t.Errorf("package inbox depends on %s", d)
		}
	}
}
