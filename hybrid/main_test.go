package hybrid

import (
	"context"
	"log"
	"testing"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}

func TestMain(m *testing.M) {
	// Outage tests make go-redis log every failed dial; keep output
	// readable.
	redis.SetLogger(quietRedis{})
	log.SetFlags(0)
	// goleak checks after the package's tests; redistest stops the servers.
	// go-redis redials a dead node from a pool goroutine that sleeps 1 s
	// between tries and exits at its next wake-up once the client is
	// closed; goleak.Find retries for a while, but not always that long.
	redistest.MainWith(m, func() error {
		return goleak.Find(goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"))
	})
}
