package remote

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/local"
)

// TestStockRecords: tokens leased under a holder's record stay counted
// until the holder reports them or the term ends, so the bucket does not
// refill behind them; a return on the record gives tokens back, one on
// another record only up to the cap; a late call changes nothing; past
// the records a bucket keeps, a lease grants need, unrecorded. On the
// script (miniredis, whose clock the test moves, and real Redis for the
// parts that need no clock) and on its Go twin.
func TestStockRecords(t *testing.T) {
	lim := local.Limit{Rate: 1, Period: time.Second, Burst: 10}
	start := time.Unix(1_700_000_000, 0)
	type world struct {
		s       Store
		advance func(time.Duration)
	}
	worlds := map[string]func(t *testing.T) world{
		"lua": func(t *testing.T) world {
			mr := miniredis.RunT(t)
			mr.SetTime(start)
			now := start
			return world{NewRedis(redis.NewClient(&redis.Options{Addr: mr.Addr()})), func(d time.Duration) {
				now = now.Add(d)
				mr.SetTime(now)
			}}
		},
		"go": func(t *testing.T) world {
			clk := clock.NewManual(start)
			return world{NewMemory(clk), clk.Advance}
		},
	}
	ctx := context.Background()
	for name, mk := range worlds {
		t.Run(name, func(t *testing.T) {
			lease := func(w world, key, holder string, n, keep, seq int64) Result {
				t.Helper()
				r := Request{Policy: "stock", Key: key, Limit: lim, Version: 1, N: n, Min: 1, Need: 1,
					Stock: Stock{Holder: holder, Keep: keep, Seq: seq, Term: 5 * time.Second, Max: 2}}
				res, err := w.s.Lease(ctx, r)
				require.NoError(t, err)
				return res
			}
			give := func(w world, key, holder string, n, seq int64) Result {
				t.Helper()
				res, err := w.s.Return(ctx, Request{Policy: "stock", Key: key, Limit: lim, Version: 1, N: n,
					Stock: Stock{Holder: holder, Seq: seq}})
				require.NoError(t, err)
				return res
			}
			t.Run("held tokens keep the bucket from refilling", func(t *testing.T) {
				w := mk(t)
				res := lease(w, "k1", "a", 10, 0, 1)
				require.Equal(t, int64(10), res.Granted)
				require.True(t, res.Held)
				w.advance(3 * time.Second)
				require.Zero(t, lease(w, "k1", "b", 1, 0, 1).Granted, "the bucket refilled behind held tokens")
				// a spent 6: its report frees them, and the bucket refills
				// from there.
				require.Zero(t, lease(w, "k1", "a", 1, 4, 2).Granted)
				w.advance(2 * time.Second)
				require.Equal(t, int64(2), lease(w, "k1", "b", 5, 0, 2).Granted)
			})
			t.Run("a record ends at its term", func(t *testing.T) {
				w := mk(t)
				require.Equal(t, int64(10), lease(w, "k2", "a", 10, 0, 1).Granted)
				w.advance(7 * time.Second) // the term ended 2 s ago
				require.Equal(t, int64(2), lease(w, "k2", "b", 5, 0, 1).Granted)
			})
			t.Run("returns", func(t *testing.T) {
				w := mk(t)
				require.Equal(t, int64(10), lease(w, "k3", "a", 10, 0, 7).Granted)
				require.Equal(t, int64(3), give(w, "k3", "a", 3, 7).Remaining, "a return on the record")
				require.Equal(t, int64(3), give(w, "k3", "a", 3, 6).Remaining, "a return on another record passed the cap")
			})
			t.Run("a release drops the record", func(t *testing.T) {
				w := mk(t)
				release := func(key string, n, seq int64) Result {
					res, err := w.s.Return(ctx, Request{Policy: "stock", Key: key, Limit: lim, Version: 1, N: n,
						Stock: Stock{Holder: "a", Seq: seq, Release: true}})
					require.NoError(t, err)
					return res
				}
				require.Equal(t, int64(10), lease(w, "k6", "a", 10, 0, 3).Granted)
				require.Equal(t, int64(4), release("k6", 4, 3).Remaining, "a gave 4 back and holds nothing more")
				require.Equal(t, int64(4), lease(w, "k6", "b", 10, 0, 1).Granted)
				require.Equal(t, int64(10), lease(w, "k7", "a", 10, 0, 3).Granted)
				require.Zero(t, release("k7", 4, 2).Remaining, "a release older than the record's lease dropped it")
			})
			t.Run("a late call changes nothing", func(t *testing.T) {
				w := mk(t)
				require.Equal(t, int64(4), lease(w, "k4", "a", 4, 0, 5).Granted)
				res := lease(w, "k4", "a", 6, 0, 4) // overtaken by call 5
				require.Zero(t, res.Granted)
				require.False(t, res.Held)
				require.Equal(t, int64(6), res.Remaining)
				// The record still holds call 5's 4 tokens: b gets the 6 left.
				require.Equal(t, int64(6), lease(w, "k4", "b", 10, 0, 1).Granted)
			})
			t.Run("tokens spent at once are not held", func(t *testing.T) {
				w := mk(t)
				r := Request{Policy: "stock", Key: "k8", Limit: lim, Version: 1, N: 4, Min: 3, Need: 3,
					Stock: Stock{Holder: "a", Spend: 3, Seq: 1, Term: 5 * time.Second}}
				res, err := w.s.Lease(ctx, r)
				require.NoError(t, err)
				require.Equal(t, int64(4), res.Granted)
				require.True(t, res.Held)
				// a holds 1 (3 of 4 spent at once): the bucket refills to 9.
				w.advance(3 * time.Second)
				require.Equal(t, int64(9), lease(w, "k8", "b", 10, 0, 1).Granted)
			})
			t.Run("past the records a bucket keeps", func(t *testing.T) {
				w := mk(t)
				require.True(t, lease(w, "k5", "a", 2, 0, 1).Held)
				require.True(t, lease(w, "k5", "b", 2, 0, 1).Held)
				res := lease(w, "k5", "c", 5, 0, 1) // Max 2
				require.Equal(t, int64(1), res.Granted, "granted need")
				require.False(t, res.Held)
			})
		})
	}
	t.Run("real redis", func(t *testing.T) {
		s := NewRedis(redistest.Standalone(t).Client(t))
		r := Request{Policy: "stock-real", Key: "k", Limit: lim, Version: 1, N: 10, Min: 1, Need: 1,
			Stock: Stock{Holder: "a", Seq: 1, Term: time.Minute}}
		res, err := s.Lease(ctx, r)
		require.NoError(t, err)
		require.True(t, res.Held)
		require.Equal(t, int64(10), res.Granted)
		r.Stock.Holder, r.N = "b", 1
		res, err = s.Lease(ctx, r)
		require.NoError(t, err)
		require.Zero(t, res.Granted, "b found tokens a holds")
	})
}

// TestStockBadInput: a stock record on a debit, a shaped limit or a
// conditional return, or out of range, is ErrInvalidGrant.
func TestStockBadInput(t *testing.T) {
	ctx := context.Background()
	base := Request{Policy: "bad", Key: "k", Limit: local.Limit{Rate: 10, Period: time.Second, Burst: 10}, Version: 1, N: 1,
		Stock: Stock{Holder: "h", Seq: 1, Term: time.Second}}
	for name, s := range map[string]Store{"memory": NewMemory(clock.Real()), "redis": NewRedis(redistest.Standalone(t).Client(t))} {
		for _, tc := range []struct {
			name string
			op   Op
			edit func(*Request)
		}{
			{"debit", OpDebit, func(*Request) {}},
			{"sliding window", OpLease, func(r *Request) { r.Window = true }},
			{"bad holder", OpLease, func(r *Request) { r.Stock.Holder = "a b" }},
			{"negative keep", OpLease, func(r *Request) { r.Stock.Keep = -1 }},
			{"keep above burst", OpLease, func(r *Request) { r.Stock.Keep = 11 }},
			{"no term", OpLease, func(r *Request) { r.Stock.Term = 0 }},
			{"negative seq", OpLease, func(r *Request) { r.Stock.Seq = -1 }},
		} {
			r := base
			tc.edit(&r)
			var err error
			switch tc.op {
			case OpDebit:
				_, err = s.Debit(ctx, r)
			case OpReturn:
				_, err = s.Return(ctx, r)
			default:
				_, err = s.Lease(ctx, r)
			}
			require.ErrorIs(t, err, ErrInvalidGrant, "%s: %s", name, tc.name)
		}
	}
}

// TestStockRecordBytes measures what a holder's record costs Redis: 64
// holders (16-character names, as hybrid's) lease on one key, and
// MEMORY USAGE of the key that keeps the records, divided by 64, stays
// under 100 bytes. The 65th holder gets no record.
func TestStockRecordBytes(t *testing.T) {
	c := redistest.Standalone(t).Client(t)
	s := NewRedis(c)
	ctx := context.Background()
	r := Request{Policy: "stock-bytes", Key: "k", Limit: local.Limit{Rate: 1000, Period: time.Second, Burst: 1000}, Version: 1, N: 10, Min: 1, Need: 1}
	for i := range defaultMaxStock + 1 {
		r.Stock = Stock{Holder: fmt.Sprintf("%016x", 0xabcdef0123456789+uint64(i)), Seq: 1, Term: time.Minute}
		res, err := s.Lease(ctx, r)
		require.NoError(t, err)
		require.Equal(t, i < defaultMaxStock, res.Held, "holder %d", i)
	}
	_, grants := bucketKeys(&r)
	used, err := c.MemoryUsage(ctx, grants).Result()
	require.NoError(t, err)
	per := float64(used) / defaultMaxStock
	t.Logf("%d records: %d bytes in Redis, %.1f bytes a record", defaultMaxStock, used, per)
	require.Less(t, per, 100.0)
}
