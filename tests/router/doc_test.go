// Package router_test holds package router's tests on the real brokers. They live outside
// package router so that a program importing router does not, through `go mod tidy` reading
// the tests of the packages it imports, download every broker client and the test kits
// (docs/modules.md): router's own tests use a fake broker.
package router_test

import _ "github.com/watermill-inbox/watermill-inbox/adapters/all" // every broker name
