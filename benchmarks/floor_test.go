package benchmarks

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
)

// BenchmarkEvalShaFloor is the least a decision that needs the store can
// allocate with go-redis, the field's client: one EVALSHA of a script that
// does nothing with one key and eleven numbers, as the bucket script takes
// them, and returns five numbers, as it answers. Issue 23 asks a cold
// decision for at most 4 allocations; this floor is what the client alone
// costs per call.
func BenchmarkEvalShaFloor(b *testing.B) {
	srv := redistest.Standalone(b)
	c := srv.Client(b)
	ctx := context.Background()
	script := redis.NewScript(`return {1, 2, 3, 4, 5}`)
	keys := []string{"leasehold:{floor:k}"}
	if err := script.Load(ctx, c).Err(); err != nil {
		b.Fatal(err)
	}
	b.Run("args=11-numbers", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := script.EvalSha(ctx, c, keys, "lease", 1, 1, 1, 100000, 10, 1, 0, -1000000, 1000, 1).Int64Slice(); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("args=none", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := script.EvalSha(ctx, c, keys).Int64Slice(); err != nil {
				b.Fatal(err)
			}
		}
	})
}
