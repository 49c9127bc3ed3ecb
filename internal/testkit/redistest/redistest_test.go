package redistest

import (
	"net"
	"strconv"
	"testing"
)

// TestFreePortLeavesTheBusFree: a cluster node's port comes with its bus
// port (+10 000) free; a make test run once failed when another process
// held a node's bus port.
func TestFreePortLeavesTheBusFree(t *testing.T) {
	for range 50 {
		port, err := freePort(true)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range []int{port, port + 10000} {
			l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
			if err != nil {
				t.Fatalf("port %d (node %d) not free: %v", p, port, err)
			}
			l.Close()
		}
	}
}
