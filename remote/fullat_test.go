package remote

import (
	"context"
	"testing"
	"time"

	"github.com/leasehold/leasehold/local"
	"github.com/stretchr/testify/require"
)

// TestReturnWithFullAt: a return that names the time to full its grant
// left gives back only while nothing but refill changed the bucket since,
// on every backend; after another take, or once the bucket is full, it
// gives nothing back and says so (Granted 0).
func TestReturnWithFullAt(t *testing.T) {
	lim := local.Limit{Rate: 10, Period: time.Second, Burst: 10} // a token every 100 ms
	ctx := context.Background()
	for _, be := range backends(t) {
		t.Run(be.name, func(t *testing.T) {
			req := Request{Policy: "fullat-" + be.name, Key: "k", Limit: lim}
			fullAt := func(r Result) time.Time { return r.Now.Add(r.ResetAfter) }
			give := func(n int64, at time.Time) Result {
				t.Helper()
				r := req
				r.N, r.FullAt = n, at
				// Through Batch, the reconciler's path.
				rep := be.store.Batch(ctx, OpReturn, []Request{r})[0]
				require.NoError(t, rep.Err)
				return rep.Result
			}
			take := func(n int64) Result {
				t.Helper()
				r := req
				r.N = n
				res, err := be.store.Lease(ctx, r)
				require.NoError(t, err)
				require.Equal(t, n, res.Granted)
				return res
			}
			first := take(6) // 4 left
			// Refill alone (2.5 tokens: a part-token carry) keeps the
			// time to full.
			be.advance(250 * time.Millisecond)
			back := give(3, fullAt(first))
			require.Equal(t, int64(3), back.Granted, "a return to a bucket only refill changed")
			require.GreaterOrEqual(t, back.Remaining, int64(9), "4 left + 2 refilled + 3 back")
			// The return changed the bucket: the same grant's time to
			// full no longer matches.
			again := give(1, fullAt(first))
			require.Zero(t, again.Granted, "a second return under the same grant")
			require.Equal(t, back.Remaining, again.Remaining)

			second := take(5)
			third := take(2)
			// A return for a grant someone took after: nothing back.
			stale := give(5, fullAt(second))
			require.Zero(t, stale.Granted, "a return under a grant taken from since")
			require.Equal(t, third.Remaining, stale.Remaining)
			// The last grant's may.
			last := give(2, fullAt(third))
			require.Equal(t, int64(2), last.Granted)
			require.Equal(t, third.Remaining+2, last.Remaining)
			// Unconditional returns still give back, and report nothing.
			plain := give(1, time.Time{})
			require.Zero(t, plain.Granted)
			require.Equal(t, last.Remaining+1, plain.Remaining)

			// Once full, the time to full is now's: a grant's no longer
			// matches, and there is no room either way.
			fourth := take(1) // 4 left
			be.advance(700 * time.Millisecond)
			full := give(1, fullAt(fourth))
			require.Zero(t, full.Granted, "a return to a bucket gone full")
			require.Equal(t, lim.Burst, full.Remaining)
		})
	}
}
