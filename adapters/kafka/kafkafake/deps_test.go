package kafkafake_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDoesNotLinkTesting: a program importing the kafka adapter or kafkafake (the demo does)
// must not link package testing (which registers its -test.* flags in the program).
func TestDoesNotLinkTesting(t *testing.T) {
	for _, pkg := range []string{
		"github.com/watermill-inbox/watermill-inbox/adapters/kafka",
		"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkafake",
		"github.com/watermill-inbox/watermill-inbox/router",
	} {
		out, err := exec.Command("go", "list", "-deps", pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			if dep == "testing" || strings.HasSuffix(dep, "/kafkatest") {
				t.Errorf("%s links %s", pkg, dep)
			}
		}
	}
}
