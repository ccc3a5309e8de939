package kafkafake_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDoesNotLinkTesting: a program importing the kafka adapter, kafkafake, the router or
// every adapter (the demo does) must not link package testing (which registers its -test.*
// flags in the program). sqsfake and the demo are modules of their own (they embed goaws):
// the demo's go.mod is checked from its directory.
func TestDoesNotLinkTesting(t *testing.T) {
	for _, pkg := range []string{
		"github.com/watermill-inbox/watermill-inbox/adapters/kafka",
		"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkafake",
		"github.com/watermill-inbox/watermill-inbox/router",
		"github.com/watermill-inbox/watermill-inbox/adapters/all",
		"../../../examples/billing",
	} {
		cmd := exec.Command("go", "list", "-deps", pkg)
		if strings.HasPrefix(pkg, ".") { // a module of its own: listed from its directory
			cmd = exec.Command("go", "list", "-deps", ".")
			cmd.Dir = pkg
		}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			if dep == "testing" || strings.HasSuffix(dep, "/kafkatest") || strings.HasSuffix(dep, "/sqstest") {
				t.Errorf("%s links %s", pkg, dep)
			}
		}
	}
}
