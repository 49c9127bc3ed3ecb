package remote

import (
	"testing"
	"time"

	"github.com/leasehold/leasehold/local"
)

// TestScriptArgsAllocations: the EVALSHA command of a plain lease is built
// with few allocations, since every cold decision builds one: the call
// with room for its keys and command, the two keys as one string, and each
// key boxed as an argument (the operation's name, the constants and the
// script's hash are boxed once, the limit's numbers once per limit), for a
// limit whose numbers do not fit a small integer. It was 4 for the keys
// and arguments, and go-redis's EvalSha 4 more for its command (a slice,
// the hash and the two keys boxed).
func TestScriptArgsAllocations(t *testing.T) {
	r := Request{Policy: "p", Key: "user-1", Limit: local.Limit{Rate: 1000, Period: time.Hour, Burst: 100_000}, MaxDelay: time.Second, Version: 1, N: 5, Min: 1, Need: 1}
	var c argCache
	a := testing.AllocsPerRun(1000, func() {
		if _, err := c.scriptArgs(OpLease, &r); err != nil {
			t.Fatal(err)
		}
	})
	t.Logf("%v allocations", a)
	if a > 4 {
		t.Fatalf("scriptArgs allocates %v times, want ≤ 4", a)
	}
}
