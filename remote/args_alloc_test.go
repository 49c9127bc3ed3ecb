package remote

import (
	"testing"
	"time"

	"github.com/leasehold/leasehold/local"
)

// TestScriptArgsAllocations: the arguments of a plain lease are built with
// few allocations, since every cold decision builds them: one for both
// slices and one for both keys (the operation's name and the constants
// are boxed once, the limit's numbers once per limit), for a limit whose
// numbers do not fit a small integer. It was 4, a slice and a key string
// each.
func TestScriptArgsAllocations(t *testing.T) {
	r := Request{Policy: "p", Key: "user-1", Limit: local.Limit{Rate: 1000, Period: time.Hour, Burst: 100_000}, MaxDelay: time.Second, Version: 1, N: 5, Min: 1, Need: 1}
	var c argCache
	a := testing.AllocsPerRun(1000, func() {
		if _, _, _, err := c.scriptArgs(OpLease, &r); err != nil {
			t.Fatal(err)
		}
	})
	t.Logf("%v allocations", a)
	if a > 2 {
		t.Fatalf("scriptArgs allocates %v times, want ≤ 2", a)
	}
}
