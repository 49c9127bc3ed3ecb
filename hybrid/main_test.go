package hybrid

import (
	"context"
	"log"
	"testing"

	"github.com/leasehold/leasehold/internal/redistest"
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
	redistest.MainWith(m, func() error { return goleak.Find() })
}
