package inbox

// stackReserve is the stack, in bytes, that reserveStack makes room for: enough for the
// claim's deepest path (pgx's batch encoding under the store's claim), measured with the CPU
// profile of BenchmarkInboxVsBareTx (`make bench-cost`).
const stackReserve = 8 << 10

// reserveStack grows the calling goroutine's stack once, while the goroutine is still
// shallow. Watermill's router runs every message in a goroutine of its own, and the batched
// mode every batch, each starting with a small stack; without this, the delivery's path grew
// it two or three times, each time copying a deeper stack (runtime.copystack was about 11% of the consumer's CPU samples at 8
// concurrent deliveries, 1.4% with it). i is any value: it only keeps the compiler from
// dropping the frame.
//
//go:noinline
func reserveStack(i int) byte {
	var b [stackReserve]byte
	return b[i&(stackReserve-1)]
}
