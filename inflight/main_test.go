package inflight

import (
	"testing"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// goleak checks after the package's tests; redistest stops the servers.
	redistest.MainWith(m, func() error {
		return goleak.Find(goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"))
	})
}
