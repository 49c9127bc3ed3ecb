package tiered

import (
	"context"
	"errors"
	"fmt"
	"github.com/leasehold/leasehold/internal/testkit/poll"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/keys"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// cuttable is a parent that fails every call while cut; while silent, a
// lease waits for its context to end, as over a link that drops every
// byte.
type cuttable struct {
	Parent
	cut, silent atomic.Bool
	calls       atomic.Int64
	waiting     atomic.Int64 // leases waiting on a silent link
}

var errCut = fmt.Errorf("parent cut: %w: %w", remote.ErrUnavailable, remote.ErrUnreachable)

func (c *cuttable) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	c.calls.Add(1)
	if c.cut.Load() {
		return remote.Result{}, errCut
	}
	if c.silent.Load() {
		c.waiting.Add(1)
		defer c.waiting.Add(-1)
		<-ctx.Done()
		return remote.Result{}, fmt.Errorf("parent silent: %w: %w", remote.ErrUnavailable, ctx.Err())
	}
	return c.Parent.Lease(ctx, r)
}

func (c *cuttable) Return(ctx context.Context, r remote.Request) (remote.Result, error) {
	if c.cut.Load() {
		return remote.Result{}, errCut
	}
	return c.Parent.Return(ctx, r)
}

func (c *cuttable) Debit(ctx context.Context, r remote.Request) (remote.Result, error) {
	if c.cut.Load() {
		return remote.Result{}, errCut
	}
	return c.Parent.Debit(ctx, r)
}

func (c *cuttable) Weigh(ctx context.Context, prefix, policy, region string, weight int64, expiry time.Duration) (int64, error) {
	if c.cut.Load() {
		return 0, errCut
	}
	return c.Parent.Weigh(ctx, prefix, policy, region, weight, expiry)
}

// tierWorld is one parent and regions on MemoryStores over one manual
// clock.
type tierWorld struct {
	clk    *clock.Manual
	parent *remote.MemoryStore
	link   *cuttable
}

func newTierWorld(t *testing.T) *tierWorld {
	t.Helper()
	// Checked after every other cleanup: the Tiered stores close first.
	running := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, running) })
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	parent := remote.NewMemory(clk)
	return &tierWorld{clk: clk, parent: parent, link: &cuttable{Parent: parent}}
}

// region returns a Tiered store of a new region store, closed when the
// test ends (and then checked for goroutines left behind).
func (w *tierWorld) region(t *testing.T, name string, local *remote.MemoryStore) *Store {
	t.Helper()
	if local == nil {
		local = remote.NewMemory(w.clk)
	}
	ts, err := New(name, local, w.link, WithClock(w.clk))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := ts.Close(); err != nil {
			t.Error(err)
		}
	})
	return ts
}

// eventually polls cond until it holds, failing the test after 5 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	poll.Until(t, what, 5*time.Second, cond)
}

var tierLimit = local.Limit{Rate: 100, Period: time.Second, Burst: 100}

func tierReq(n int64) remote.Request {
	return remote.Request{Policy: "p", Key: "k", Limit: tierLimit, Version: 1, N: n, Min: 1, Need: 1}
}

// parentLevel is the parent bucket's level now, read by a lease of the
// whole Burst that takes all or nothing (and gives all back).
func (w *tierWorld) parentLevel(t *testing.T) int64 {
	t.Helper()
	ctx := context.Background()
	probe := tierReq(tierLimit.Burst)
	probe.Min, probe.Need = probe.N, probe.N
	res, err := w.parent.Lease(ctx, probe)
	if err != nil {
		t.Fatal(err)
	}
	if res.Granted > 0 {
		probe.N = res.Granted
		if _, err := w.parent.Return(ctx, probe); err != nil {
			t.Fatal(err)
		}
		return res.Granted
	}
	return res.Remaining
}

func TestTieredLeasesOnlyWhatTheParentGranted(t *testing.T) {
	w := newTierWorld(t)
	regionStore := remote.NewMemory(w.clk)
	a, b := w.region(t, "eu", regionStore), w.region(t, "eu", regionStore)
	ctx := context.Background()

	// A key new to the region: the first lease finds the pool empty and
	// claims its first refill; it is refused for about a round trip.
	res, err := a.Lease(ctx, tierReq(10))
	if err != nil || res.Granted != 0 || res.RetryAfter <= 0 || res.RetryAfter > 100*time.Millisecond {
		t.Fatalf("first lease of a new key = %+v, %v; want a refusal for at most 100 ms (a third of the gap, before any round trip was measured)", res, err)
	}
	eventually(t, "refill", func() bool { return a.Stats().Refills == 1 })
	if got := w.link.calls.Load(); got != 1 {
		t.Fatalf("%d parent leases for one region's first demand, want 1", got)
	}
	// No demand seen yet: the rate over two gaps (60), capped at half the
	// Burst.
	if lvl := w.parentLevel(t); lvl != 100-50 {
		t.Fatalf("parent level %d after the first batch, want 50", lvl)
	}
	granted := int64(0)
	for {
		res, err := b.Lease(ctx, tierReq(5))
		if err != nil {
			t.Fatal(err)
		}
		if res.Granted == 0 {
			break
		}
		granted += res.Granted
	}
	if granted != 50 {
		t.Fatalf("the region granted %d from a batch of 50", granted)
	}
	// Dry: the refill waits for the gap, whoever asks.
	if res, _ := a.Lease(ctx, tierReq(5)); res.Granted != 0 {
		t.Fatalf("dry pool granted %d", res.Granted)
	}
	if w.link.calls.Load() != 1 {
		t.Fatal("a refill within the gap")
	}
	w.clk.Advance(400 * time.Millisecond)
	if res, _ := a.Lease(ctx, tierReq(5)); res.Granted != 0 {
		t.Fatalf("dry pool granted %d", res.Granted)
	}
	eventually(t, "second refill", func() bool { return a.Stats().Refills+b.Stats().Refills == 2 })
	// The parent refilled 40 meanwhile; the batch is the demand since the
	// first refill (50 granted and 3×5 refused in 400 ms) over the 500 ms
	// horizon, capped at 50.
	if lvl := w.parentLevel(t); lvl != 50+40-50 {
		t.Fatalf("parent level %d, want %d", lvl, 50+40-50)
	}
}

func TestTieredGivesIdlePoolsBack(t *testing.T) {
	w := newTierWorld(t)
	ts := w.region(t, "us", nil)
	ctx := context.Background()
	_, _ = ts.Lease(ctx, tierReq(1))
	eventually(t, "refill", func() bool { return ts.Stats().Refills == 1 })
	if res, _ := ts.Lease(ctx, tierReq(2)); res.Granted != 2 {
		t.Fatalf("granted %d", res.Granted)
	}
	w.clk.Advance(2*time.Second + 2*time.Millisecond) // the pool TTL
	eventually(t, "give back", func() bool { return ts.Stats().GivenBack == 48 })
	// The parent refilled to its Burst meanwhile; the pool's 48 came back
	// on top, capped at Burst.
	if lvl := w.parentLevel(t); lvl != 100 {
		t.Fatalf("parent level %d after the give-back", lvl)
	}
}

func TestTieredParentCut(t *testing.T) {
	w := newTierWorld(t)
	ts := w.region(t, "ap", nil)
	ctx := context.Background()
	_, _ = ts.Lease(ctx, tierReq(1))
	eventually(t, "refill", func() bool { return ts.Stats().Refills == 1 })
	w.link.cut.Store(true)
	w.clk.Advance(400 * time.Millisecond) // past the refill gap
	// The pool still serves what it holds (50), without the parent.
	res, err := ts.Lease(ctx, tierReq(50))
	if err != nil || res.Granted != 50 {
		t.Fatalf("lease from the pool while cut = %+v, %v", res, err)
	}
	eventually(t, "failed refill", func() bool { return ts.Stats().Failures == 1 })
	_, err = ts.Lease(ctx, tierReq(1))
	if !errors.Is(err, remote.ErrUnavailable) || !errors.Is(err, remote.ErrUnreachable) {
		t.Fatalf("dry pool, parent cut: err %v; want ErrUnavailable and ErrUnreachable", err)
	}
	// Debits go to the parent: they fail while it is away.
	if _, err := ts.Debit(ctx, tierReq(3)); !errors.Is(err, remote.ErrUnavailable) {
		t.Fatalf("debit while cut: %v", err)
	}
	w.link.cut.Store(false)
	// Still failing until a refill gets through (the next claim, one gap on).
	if _, err := ts.Lease(ctx, tierReq(1)); !errors.Is(err, remote.ErrUnavailable) {
		t.Fatalf("before the next refill: %v", err)
	}
	w.clk.Advance(400 * time.Millisecond)
	_, _ = ts.Lease(ctx, tierReq(1))
	eventually(t, "refill after the cut", func() bool { return ts.Stats().Refills == 2 })
	if res, err := ts.Lease(ctx, tierReq(1)); err != nil || res.Granted != 1 {
		t.Fatalf("after the cut = %+v, %v", res, err)
	}
	before := w.parentLevel(t)
	if _, err := ts.Debit(ctx, tierReq(30)); err != nil {
		t.Fatal(err)
	}
	if lvl := w.parentLevel(t); lvl != before-30 {
		t.Fatalf("debit of 30 took the parent from %d to %d", before, lvl)
	}
}

// TestTieredSilentParent: a refill that has no answer from the parent
// within a quarter of the parent timeout marks the pool, so the region's
// processes learn the parent is away while the call still waits, as soon
// as a refused link would tell them; the next refill that gets through
// clears it.
func TestTieredSilentParent(t *testing.T) {
	w := newTierWorld(t)
	ts := w.region(t, "sa", nil)
	ctx := context.Background()
	_, _ = ts.Lease(ctx, tierReq(1))
	eventually(t, "refill", func() bool { return ts.Stats().Refills == 1 })
	w.link.silent.Store(true)
	w.clk.Advance(400 * time.Millisecond) // past the refill gap
	if res, err := ts.Lease(ctx, tierReq(50)); err != nil || res.Granted != 50 {
		t.Fatalf("lease from the pool while silent = %+v, %v", res, err)
	}
	eventually(t, "a refill waiting on the silent parent", func() bool { return w.link.waiting.Load() == 1 })
	if _, err := ts.Lease(ctx, tierReq(1)); err != nil {
		t.Fatalf("before the silence is a quarter of the timeout old: %v", err)
	}
	w.clk.Advance(500 * time.Millisecond) // a quarter of the 2 s parent timeout
	eventually(t, "the pool marked", func() bool {
		_, err := ts.Lease(ctx, tierReq(1))
		return errors.Is(err, remote.ErrUnavailable)
	})
	if w.link.waiting.Load() == 0 || ts.Stats().Failures != 0 {
		t.Fatalf("the pool was marked only once the parent call ended (waiting %d, calls %d, stats %+v): the mark is for a call still waiting", w.link.waiting.Load(), w.link.calls.Load(), ts.Stats())
	}
	w.link.silent.Store(false)
	eventually(t, "the silent call timed out", func() bool { return w.link.waiting.Load() == 0 })
	w.clk.Advance(400 * time.Millisecond)
	_, _ = ts.Lease(ctx, tierReq(1))
	eventually(t, "refill after the silence", func() bool { return ts.Stats().Refills == 2 })
	if res, err := ts.Lease(ctx, tierReq(1)); err != nil || res.Granted != 1 {
		t.Fatalf("after the silence = %+v, %v", res, err)
	}
}

func TestTieredPolicyAndStaleVersions(t *testing.T) {
	w := newTierWorld(t)
	euStore, usStore := remote.NewMemory(w.clk), remote.NewMemory(w.clk)
	eu, us := w.region(t, "eu", euStore), w.region(t, "us", usStore)
	ctx := context.Background()
	changed := make(chan struct{}, 1)
	stop, err := us.WatchPolicy(ctx, "", "p", func() { changed <- struct{}{} })
	if err != nil {
		t.Fatal(err)
	}
	defer stop()

	v2 := remote.PolicyRecord{Version: 2, Limit: local.Limit{Rate: 50, Period: time.Second, Burst: 50}}
	if _, stored, err := eu.SetPolicy(ctx, "", "p", v2); err != nil || !stored {
		t.Fatalf("SetPolicy in eu: %v %v", stored, err)
	}
	<-changed
	for name, s := range map[string]*Store{"eu": eu, "us": us} {
		rec, ok, err := s.GetPolicy(ctx, "", "p")
		if err != nil || !ok || rec.Version != 2 {
			t.Fatalf("%s reads %+v %v %v after a change made in eu", name, rec, ok, err)
		}
	}
	// eu's limiters lease at version 2, which the parent's bucket takes
	// on; one still on version 1 in us learns of 2 from its pool once a
	// refill met it at the parent.
	req := tierReq(1)
	v2req := req
	v2req.Version, v2req.Limit = 2, v2.Limit
	_, _ = eu.Lease(ctx, v2req)
	eventually(t, "eu refill", func() bool { return eu.Stats().Refills == 1 })
	_, _ = us.Lease(ctx, req)
	var res remote.Result
	eventually(t, "us refill meets version 2", func() bool {
		res, err = us.Lease(ctx, req)
		return err != nil || res.Stale
	})
	if err != nil || !res.Stale || res.Version != 2 || res.Granted != 0 {
		t.Fatalf("lease at version 1 = %+v, %v; want Stale at version 2", res, err)
	}
	w.clk.Advance(400 * time.Millisecond)
	_, _ = us.Lease(ctx, v2req)
	eventually(t, "us refill at version 2", func() bool { return us.Stats().Refills == 1 })
	if res, err := us.Lease(ctx, v2req); err != nil || res.Granted != 1 {
		t.Fatalf("lease at version 2 = %+v, %v", res, err)
	}
}

func TestTieredWorldWeight(t *testing.T) {
	w := newTierWorld(t)
	eu, us := w.region(t, "eu", nil), w.region(t, "us", nil)
	ctx := context.Background()
	beat := func(s *Store, members ...string) int {
		n := 0
		for _, m := range members {
			var err error
			if n, err = s.Heartbeat(ctx, "", "p", m, 3*time.Second); err != nil {
				t.Fatal(err)
			}
		}
		return n
	}
	// Before any beat came back a region counts its own limiters.
	if n := beat(eu, "a", "b"); n != 2 {
		t.Fatalf("eu alone: %d, want its own 2", n)
	}
	eventually(t, "eu's first beat", func() bool { return eu.Stats().ParentCalls == 2 })
	// A beat reports the count of the heartbeat that claimed it and reads
	// what the others reported before: three rounds of beats carry every
	// region's full count everywhere.
	for round := range 3 {
		w.clk.Advance(2 * time.Second)
		calls := eu.Stats().ParentCalls + us.Stats().ParentCalls
		beat(eu, "a", "b")
		beat(us, "c", "d", "e")
		eventually(t, fmt.Sprintf("beats of round %d", round), func() bool {
			return eu.Stats().ParentCalls+us.Stats().ParentCalls >= calls+4 // weigh and policy read, each
		})
	}
	if n, m := beat(eu, "a"), beat(us, "c"); n != 5 || m != 5 {
		t.Fatalf("world weight: eu %d, us %d; want 5", n, m)
	}
	// Cut off, a region keeps the world it knew.
	w.link.cut.Store(true)
	w.clk.Advance(2 * time.Second)
	_ = beat(eu, "a", "b")
	eventually(t, "failed beat", func() bool { return eu.Stats().Failures >= 1 })
	if n := beat(eu, "a"); n != 5 {
		t.Fatalf("eu while cut: %d, want the last world weight 5", n)
	}
}

func TestTieredWindowTokensLapse(t *testing.T) {
	w := newTierWorld(t)
	regionStore := remote.NewMemory(w.clk)
	ts := w.region(t, "sa", regionStore)
	ctx := context.Background()
	win := local.Limit{Rate: 100, Period: 10 * time.Second, Burst: 100}
	req := remote.Request{Policy: "w", Key: "k", Limit: win, Window: true, Hold: 100 * time.Millisecond, Version: 1, N: 5, Min: 1, Need: 1}
	_, _ = ts.Lease(ctx, req)
	eventually(t, "refill", func() bool { return ts.Stats().Refills == 1 })
	if res, err := ts.Lease(ctx, req); err != nil || res.Granted != 5 {
		t.Fatalf("window lease = %+v, %v", res, err)
	}
	// The parent counts the batch one second (Period/10) on: the pool
	// hands tokens out while the process's hold (100 ms) still ends before.
	w.clk.Advance(899*time.Millisecond - 100*time.Millisecond)
	if res, _ := ts.Lease(ctx, req); res.Granted != 5 {
		t.Fatalf("granted %d just before the lapse", res.Granted)
	}
	w.clk.Advance(2 * time.Millisecond)
	if res, _ := ts.Lease(ctx, req); res.Granted != 0 {
		t.Fatalf("granted %d from lapsed window tokens", res.Granted)
	}
	// Tokens given back from a batch that lapsed are dropped (the take
	// that found it lapsed claimed the next one: wait for it to land).
	eventually(t, "the next batch", func() bool { return ts.Stats().Refills == 2 })
	level := func() int64 {
		rep, err := ts.recs.pool(ctx, keys.Pool("", "w", "", "k"), poolRead{})
		if err != nil {
			t.Fatal(err)
		}
		return rep.st.level
	}
	before := level()
	back := req
	back.Since = time.UnixMicro(w.clk.Now().Add(-800 * time.Millisecond).UnixMicro())
	if _, err := ts.Return(ctx, back); err != nil {
		t.Fatal(err)
	}
	if after := level(); after != before {
		t.Fatalf("window pool went from %d to %d on a return from a lapsed batch", before, after)
	}
}

// TestTieredWindowGivesLapsedTokensBack: what a window pool did not hand
// out before its tokens lapsed goes back to the parent's window, from the
// sub-window of the grant, so the window does not count tokens never
// spent; and lapsed tokens never come back to life with the next batch.
func TestTieredWindowGivesLapsedTokensBack(t *testing.T) {
	w := newTierWorld(t)
	ts := w.region(t, "sa", nil)
	ctx := context.Background()
	win := local.Limit{Rate: 100, Period: 10 * time.Second, Burst: 100}
	req := remote.Request{Policy: "w", Key: "k", Limit: win, Window: true, Hold: 100 * time.Millisecond, Version: 1, N: 5, Min: 1, Need: 1}
	_, _ = ts.Lease(ctx, req)
	eventually(t, "refill", func() bool { return ts.Stats().Refills == 1 })
	res, _ := ts.Lease(ctx, req)
	if res.Granted != 5 {
		t.Fatalf("granted %d", res.Granted)
	}
	// A process gives 2 back: from this batch, they go back into it.
	back := req
	back.N, back.Since = 2, res.Now
	if _, err := ts.Return(ctx, back); err != nil {
		t.Fatal(err)
	}
	if res, _ := ts.Lease(ctx, req); res.Granted != 5 {
		t.Fatalf("granted %d", res.Granted)
	}
	// Older than the batch: they do not.
	back.Since = res.Now.Add(-time.Second)
	if _, err := ts.Return(ctx, back); err != nil {
		t.Fatal(err)
	}
	// The batch is 12 (a quarter of half the window's rate, no demand
	// seen): 12 - 10 + 2 = 4 are left when the pool's tokens lapse, 900
	// ms on.
	w.clk.Advance(901 * time.Millisecond)
	eventually(t, "give-back", func() bool { return ts.Stats().GivenBack == 4 })
	// The parent's window holds only the 8 handed out: 92 more fit now.
	probe := req
	probe.N, probe.Hold = 92, 0
	if res, err := w.parent.Lease(ctx, probe); err != nil || res.Granted != 92 {
		t.Fatalf("the parent's window after the give-back: %+v, %v; want 92 free", res, err)
	}
}

// TestPoolLapsedWindowTokensStayDead: a window pool's tokens that lapsed
// with no take to clear them are not revived by the next batch.
func TestPoolLapsedWindowTokensStayDead(t *testing.T) {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	s, err := recordsOf(remote.NewMemory(clk))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	now := micros(clk.Now().UnixMicro())
	if _, err := s.pool(ctx, "p", poolPut{N: 10, Exp: now + 1000, Version: 1, Window: true, Since: now}); err != nil {
		t.Fatal(err)
	}
	clk.Advance(2 * time.Millisecond) // lapsed, and no take saw it
	now = micros(clk.Now().UnixMicro())
	rep, err := s.pool(ctx, "p", poolPut{N: 3, Exp: now + 1000, Version: 1, Window: true, Since: now})
	if err != nil {
		t.Fatal(err)
	}
	if rep.st.level != 3 || rep.st.since != now {
		t.Fatalf("after a new batch on lapsed tokens: level %d since %d; want 3 since %d", rep.st.level, rep.st.since, now)
	}
}

func TestTieredBadInput(t *testing.T) {
	w := newTierWorld(t)
	local := remote.NewMemory(w.clk)
	for _, tc := range []struct {
		name   string
		region string
		opts   []Option
	}{
		{"empty region", "", nil},
		{"zero gap", "r", []Option{WithRefillGap(0)}},
		{"negative TTL", "r", []Option{WithPoolTTL(-time.Second)}},
		{"nil clock", "r", []Option{WithClock(nil)}},
	} {
		if _, err := New(tc.region, local, w.link, tc.opts...); err == nil {
			t.Errorf("%s: no error", tc.name)
		}
	}
	ts := w.region(t, "r", local)
	ctx := context.Background()
	bad := tierReq(1)
	bad.Key = ""
	for op, f := range map[string]func(context.Context, remote.Request) (remote.Result, error){"lease": ts.Lease, "return": ts.Return, "debit": ts.Debit} {
		if _, err := f(ctx, bad); !errors.Is(err, remote.ErrInvalidKey) {
			t.Errorf("%s with an empty key: %v, want ErrInvalidKey", op, err)
		}
	}
	if _, err := ts.Heartbeat(ctx, "", "p", "", time.Second); !errors.Is(err, remote.ErrInvalidKey) {
		t.Errorf("heartbeat with no member: %v", err)
	}
	if _, err := w.parent.Weigh(ctx, "", "p", "r", -1, time.Second); err == nil {
		t.Error("negative weight accepted")
	}
}

// TestPoolForeignData: a pool or world key that holds something leasehold
// did not write is ErrCorruptState, never a wrong answer.
func TestPoolForeignData(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	s := redisRecords{c: c}
	ctx := context.Background()
	key := keys.Pool("", "p", "", "k")
	for name, write := range map[string]func(){
		"string":      func() { mr.Set(key, "hello") },
		"short state": func() { mr.Set(key, "Q 1 2 3") },
		"non-numbers": func() { mr.Set(key, "Q a b c d e f g h i") },
		"fraction":    func() { mr.Set(key, "Q 1.5 0 0 0 0 0 0 0 0") },
		"hash":        func() { mr.Del(key); mr.HSet(key, "f", "v") },
	} {
		mr.Del(key)
		write()
		if _, err := s.pool(ctx, key, poolTake{N: 1, Need: 1, LowWater: 1, Claim: 1000, Version: 1}); !errors.Is(err, remote.ErrCorruptState) {
			t.Errorf("%s: %v, want ErrCorruptState", name, err)
		}
	}
	mr.Set(keys.World("", "p"), "not a hash")
	if _, err := remote.NewRedis(c).Weigh(ctx, "", "p", "r", 1, time.Second); !errors.Is(err, remote.ErrCorruptState) {
		t.Errorf("world key of another type: %v, want ErrCorruptState", err)
	}
}

// TestTieredOnRealRedis: a region on the real cluster leasing from a real
// standalone parent: refills, give-backs, SCRIPT FLUSH on the region's
// nodes, and foreign data in the region's pool and the parent's world key.
func TestTieredOnRealRedis(t *testing.T) {
	// Checked after every cleanup, once the clients below are closed.
	running := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, running) })
	cluster := redistest.SharedCluster(t).Client(t)
	parentClient := redistest.Standalone(t).Client(t)
	ts, err := New("eu", remote.NewRedis(cluster), remote.NewRedis(parentClient), WithPoolTTL(300*time.Millisecond), WithRefillGap(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer ts.Close()
	ctx := context.Background()
	policy := fmt.Sprintf("%s-%d", t.Name(), time.Now().UnixNano()) // the servers outlive a run
	req := remote.Request{Policy: policy, Key: "k", Limit: tierLimit, Version: 1, N: 5, Min: 1, Need: 1}
	granted, start := int64(0), time.Now()
	eventually(t, "tokens through the region", func() bool {
		redistest.FlushScripts(t, cluster)
		res, err := ts.Lease(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		granted += res.Granted
		return granted >= 20
	})
	// Every token came from the parent's bucket: it holds at most its
	// Burst and refill since, less what the region granted.
	peek, err := remote.NewRedis(parentClient).Debit(ctx, remote.Request{Policy: policy, Key: "k", Limit: tierLimit, Version: 1, N: 1})
	if err != nil {
		t.Fatal(err)
	}
	if most := tierLimit.Burst + int64(time.Since(start).Seconds()*float64(tierLimit.Rate)) - granted - 1; peek.Remaining > most {
		t.Fatalf("parent holds %d after the region granted %d, want at most %d", peek.Remaining, granted, most)
	}
	eventually(t, "give-back to the parent", func() bool { return ts.Stats().GivenBack > 0 })

	poolKey := keys.Pool("", policy, "", "k")
	require.NoError(t, cluster.Del(ctx, poolKey).Err())
	require.NoError(t, cluster.HSet(ctx, poolKey, "f", "v").Err())
	if _, err := ts.Lease(ctx, req); !errors.Is(err, remote.ErrCorruptState) {
		t.Fatalf("pool key holding a hash: %v, want ErrCorruptState", err)
	}
	world := keys.World("", policy)
	require.NoError(t, parentClient.Set(ctx, world, "x", 0).Err())
	if _, err := remote.NewRedis(parentClient).Weigh(ctx, "", policy, "eu", 1, time.Second); !errors.Is(err, remote.ErrCorruptState) {
		t.Fatalf("world key holding a string: %v, want ErrCorruptState", err)
	}
}

// TestTieredNests: a region leasing from a continent that leases from the
// world (refills inline, so the run replays exactly). Tokens flow down both
// tiers, and the region grants no more than the world's bucket did.
func TestTieredNests(t *testing.T) {
	w := newTierWorld(t)
	inline := WithSpawn(func(run func()) { run() })
	continent, err := New("europe", remote.NewMemory(w.clk), w.link, WithClock(w.clk), inline)
	if err != nil {
		t.Fatal(err)
	}
	defer continent.Close()
	region, err := New("eu-west", remote.NewMemory(w.clk), continent, WithClock(w.clk), inline)
	if err != nil {
		t.Fatal(err)
	}
	defer region.Close()
	ctx := context.Background()
	granted, grants := int64(0), 0
	for range 80 { // 8 s
		res, err := region.Lease(ctx, tierReq(5))
		if err != nil {
			t.Fatal(err)
		}
		if res.Granted > 0 {
			granted += res.Granted
			grants++
		}
		w.clk.Advance(100 * time.Millisecond)
	}
	// The world's bucket granted at most its Burst and 8 s of refill.
	if grants < 40 || granted > 100+800 {
		t.Fatalf("%d grants, %d tokens through two tiers in 8 s; want most calls served, at most 900 tokens", grants, granted)
	}
	if c, r := continent.Stats(), region.Stats(); c.Refills == 0 || r.Refills == 0 {
		t.Fatalf("refills: continent %+v, region %+v", c, r)
	}
	n, err := region.Heartbeat(ctx, "", "p", "a", 3*time.Second)
	if err != nil || n != 1 {
		t.Fatalf("heartbeat through two tiers: %d, %v", n, err)
	}
}

// TestTieredRegionStoreDown: a region whose own Redis is gone fails its
// calls as any store outage (the limiters fall back to their shares), and
// tells it apart from a parent that is down.
func TestTieredRegionStoreDown(t *testing.T) {
	w := newTierWorld(t)
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	defer c.Close()
	ts, err := New("eu", remote.NewRedis(c), w.link)
	if err != nil {
		t.Fatal(err)
	}
	defer ts.Close()
	ctx := context.Background()
	if _, err := ts.Lease(ctx, tierReq(1)); err != nil {
		t.Fatal(err)
	}
	mr.Close()
	for name, call := range map[string]func() error{
		"lease":     func() error { _, err := ts.Lease(ctx, tierReq(1)); return err },
		"return":    func() error { _, err := ts.Return(ctx, tierReq(1)); return err },
		"heartbeat": func() error { _, err := ts.Heartbeat(ctx, "", "p", "a", time.Second); return err },
		"policy":    func() error { _, _, err := ts.GetPolicy(ctx, "", "p"); return err },
	} {
		err := call()
		if !errors.Is(err, remote.ErrUnavailable) {
			t.Errorf("%s with the region's Redis gone: %v, want ErrUnavailable", name, err)
		}
		if strings.Contains(fmt.Sprint(err), "parent") {
			t.Errorf("%s: %v blames the parent", name, err)
		}
	}
}

// TestTieredOldVersionTokensGoBack: when a refill finds the policy changed
// at the parent, what the pool still held under the old version goes back
// to the parent, as a limiter gives back its leases on a change.
func TestTieredOldVersionTokensGoBack(t *testing.T) {
	w := newTierWorld(t)
	eu, us := w.region(t, "eu", nil), w.region(t, "us", nil)
	ctx := context.Background()
	v1 := tierReq(45)
	_, _ = us.Lease(ctx, v1)
	eventually(t, "us refill at v1", func() bool { return us.Stats().Refills == 1 })
	if res, err := us.Lease(ctx, v1); err != nil || res.Granted != 45 {
		t.Fatalf("lease at v1 = %+v, %v", res, err) // 5 of the batch of 50 stay in the pool
	}
	v2 := v1
	v2.Version, v2.N = 2, 1
	_, _ = eu.Lease(ctx, v2) // the parent's bucket moves to version 2
	eventually(t, "eu refill at v2", func() bool { return eu.Stats().Refills == 1 })

	w.clk.Advance(400 * time.Millisecond)
	v1.N = 1
	_, _ = us.Lease(ctx, v1) // below low water: us refills, and meets v2
	eventually(t, "old tokens back", func() bool { return us.Stats().GivenBack == 4 })
	if res, err := us.Lease(ctx, v1); err != nil || !res.Stale || res.Version != 2 {
		t.Fatalf("lease at v1 after the refill = %+v, %v; want Stale at v2", res, err)
	}
}

// TestTieredBatchSize: a refill asks for the region's demand over the
// horizon (or two round trips to a far parent), at least the rate over two
// gaps, at most half the Burst or the horizon's rate.
func TestTieredBatchSize(t *testing.T) {
	w := newTierWorld(t)
	ts := w.region(t, "eu", nil)
	fast := local.Limit{Rate: 1000, Period: time.Second, Burst: 2000}
	slow := local.Limit{Rate: 10, Period: time.Second, Burst: 10}
	for _, tc := range []struct {
		name      string
		lim       local.Limit
		also      []local.Limit
		n         int64
		used      int64
		dt        micros // since the last refill (0: no refill yet)
		rttMicros int64
		want      int64
	}{
		{"no demand seen: at least two gaps of the rate", fast, nil, 1, 0, 0, 100_000, 600},
		{"demand over the horizon", fast, nil, 1, 300, 200_000, 100_000, 750},
		{"capped at half the burst", fast, nil, 1, 5000, 200_000, 100_000, 1000},
		{"a far parent: two round trips of demand", fast, nil, 1, 150, 200_000, 600_000, 900},
		{"a far parent: the cap grows to two round trips of rate", fast, nil, 1, 5000, 200_000, 600_000, 1200},
		{"slow limit: half its burst", slow, nil, 1, 0, 0, 100_000, 5},
		{"the tightest of several limits", fast, []local.Limit{slow}, 1, 300, 200_000, 100_000, 5},
		{"a large request", fast, nil, 900, 0, 0, 100_000, 900},
		{"the cap wins over the request", slow, nil, 9, 0, 0, 100_000, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ts.rttMicros.Store(tc.rttMicros)
			r := remote.Request{Limit: tc.lim, Also: tc.also, N: tc.n}
			rep := poolReply{now: 1_000_000 + tc.dt, st: poolState{used: tc.used}}
			if tc.dt > 0 {
				rep.st.at = 1_000_000
			}
			if got := ts.want(&r, rep); got != tc.want {
				t.Fatalf("want = %d, want %d", got, tc.want)
			}
		})
	}
}
