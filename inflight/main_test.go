package inflight

import (
	"fmt"
	"os"
	"testing"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if addrs := os.Getenv(helperEnv); addrs != "" {
		if err := runHelper(addrs); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	// goleak checks after the package's tests; redistest stops the servers.
	redistest.MainWith(m, func() error {
		return goleak.Find(goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"))
	})
}
