package remote

import (
	"testing"
	"time"

	"github.com/leasehold/leasehold/local"
)

// TestScriptArgsAllocations: the arguments of a plain lease are built with
// few allocations, since every cold decision builds them: the slices, the
// two keys, and the one number of the limit that does not fit a small
// integer (the operation's name and the constants are boxed once).
func TestScriptArgsAllocations(t *testing.T) {
	r := Request{Policy: "p", Key: "user-1", Limit: local.Limit{Rate: 10, Period: time.Second, Burst: 10}, Version: 1, N: 5, Min: 1, Need: 1}
	a := testing.AllocsPerRun(1000, func() {
		if _, _, _, err := scriptArgs(OpLease, &r); err != nil {
			t.Fatal(err)
		}
	})
	t.Logf("%v allocations", a)
	if a > 6 {
		t.Fatalf("scriptArgs allocates %v times, want ≤ 6", a)
	}
}
