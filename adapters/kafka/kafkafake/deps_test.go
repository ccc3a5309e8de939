package kafkafake_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDoesNotLinkTesting: a program importing the kafka adapter, kafkafake, sqsfake or the
// router (the demo does: it is checked too) must not link package testing (which registers
// its -test.* flags in the program).
func TestDoesNotLinkTesting(t *testing.T) {
	for _, pkg := range []string{
		"github.com/watermill-inbox/watermill-inbox/adapters/kafka",
		"github.com/watermill-inbox/watermill-inbox/adapters/kafka/kafkafake",
		"github.com/watermill-inbox/watermill-inbox/router",
		"github.com/watermill-inbox/watermill-inbox/adapters/sqs/sqsfake",
		"github.com/watermill-inbox/watermill-inbox/examples/billing",
	} {
		out, err := exec.Command("go", "list", "-deps", pkg).CombinedOutput()
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
