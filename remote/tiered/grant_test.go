package tiered

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/leasehold/leasehold/remote"
)

func (c *cuttable) Grant(ctx context.Context, r remote.GrantRequest) (remote.Grant, error) {
	c.calls.Add(1)
	if c.cut.Load() {
		return remote.Grant{}, errCut
	}
	return c.Parent.(remote.Granter).Grant(ctx, r)
}

func (c *cuttable) Ungrant(ctx context.Context, r remote.GrantRequest, unspent int64) (remote.Result, error) {
	c.calls.Add(1)
	if c.cut.Load() {
		return remote.Result{}, errCut
	}
	return c.Parent.(remote.Granter).Ungrant(ctx, r, unspent)
}

// grantRegion returns a region store with capacity leases of term whose
// pool for tierReq's key holds a grant: a first batch, its demand taken
// and one refused take, then a grant call one gap later.
func (w *tierWorld) grantRegion(t *testing.T, name string, term time.Duration) *Store {
	t.Helper()
	// Background calls run inline, on the caller's goroutine: each step
	// of a test sees every call it started done.
	ts, err := New(name, remote.NewMemory(w.clk), w.link, WithClock(w.clk), WithCapacityLeases(term),
		WithSpawn(func(run func()) { run() }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ts.Close() })
	ctx := context.Background()
	_, _ = ts.Lease(ctx, tierReq(1))
	if ts.Stats().Refills != 1 {
		t.Fatalf("first batch: %+v", ts.Stats())
	}
	for {
		res, err := ts.Lease(ctx, tierReq(10))
		if err != nil {
			t.Fatal(err)
		}
		if res.Granted == 0 {
			break
		}
	}
	w.clk.Advance(400 * time.Millisecond) // past the gap
	_, _ = ts.Lease(ctx, tierReq(10))
	if ts.Stats().Refills != 2 {
		t.Fatalf("grant call: %+v", ts.Stats())
	}
	return ts
}

// TestGrantPoolSpendsItsGrant: a region whose key has demand holds a
// capacity grant and its pool refills itself at the grant's rate, with no
// parent call between renewals; cut off from the parent, it keeps
// admitting by its grant, exactly, until the grant ends, and only then
// fails as an outage; an idle pool gives its grant back.
func TestGrantPoolSpendsItsGrant(t *testing.T) {
	w := newTierWorld(t)
	ctx := context.Background()
	// Another holder has half the rate already: with the region's grant
	// the parent's bucket refills with nothing, so the pool's tokens are
	// its grant's alone once the bucket's level is spent.
	other := remote.GrantRequest{Request: tierReq(0), Holder: "other", Want: remote.GrantUnits / 2, Burst: 1, Term: time.Hour}
	if g, err := w.parent.Grant(ctx, other); err != nil || g.Share != remote.GrantUnits/2 {
		t.Fatalf("the other holder's grant: %+v, %v", g, err)
	}
	const term = 10 * time.Second
	ts := w.grantRegion(t, "eu", term)
	// A first grant call asks at most half the rate (512 of 1 024 units,
	// 50 tokens/s), and a burst of Burst/8 = 12, all in hand at once.
	if got := offer(t, ts, 12); got != 12 {
		t.Fatalf("first tokens of the grant: %d, want its burst, 12", got)
	}
	// The region offers twice its grant. The first take the pool cannot
	// serve claims a batch of what the bucket holds besides the grants
	// (its refill is 0: the grants hold the whole rate), once the young
	// grant's renewals, a gap apart for its first eighth of the term, are
	// done.
	spare := w.parentLevel(t)
	var first int64
	for range 40 {
		w.clk.Advance(100 * time.Millisecond)
		first += offer(t, ts, 10)
	}
	if first != spare+200 || w.parentLevel(t) != 0 {
		t.Fatalf("first 4 s: %d admitted, want the bucket's %d and 200 of the grant; bucket level now %d", first, spare, w.parentLevel(t))
	}
	calls := w.link.calls.Load()
	for i := range 10 {
		w.clk.Advance(100 * time.Millisecond)
		if got := offer(t, ts, 10); got != 5 {
			t.Fatalf("step %d: the pool served %d in 100 ms, want its grant's 5 (50/s)", i, got)
		}
	}
	if d := w.link.calls.Load() - calls; d > 1 {
		t.Fatalf("%d parent calls in 1 s of a held grant, want at most one renewal", d)
	}

	// Cut off: the grant goes on until a margin before its term, counted
	// from the claim of the call that last renewed it.
	w.link.cut.Store(true)
	var during int64
	step := 100 * time.Millisecond
	for range 70 { // to 9.4 s after the grant call's claim
		w.clk.Advance(step)
		n, err := ts.Lease(context.Background(), tierReq(50))
		if err != nil {
			t.Fatalf("cut off within the term: %v", err)
		}
		during += n.Granted
	}
	if during != 7*50 {
		t.Fatalf("admitted %d over 7 s cut off, want exactly the grant's 350", during)
	}
	if ts.Stats().Failures == 0 {
		t.Fatal("no renewal was tried while cut off")
	}
	w.clk.Advance(term) // past the grant's end
	_, err := ts.Lease(context.Background(), tierReq(1))
	for errors.Is(err, nil) {
		// The tokens accrued before the end are still there.
		_, err = ts.Lease(context.Background(), tierReq(1))
	}
	if !errors.Is(err, remote.ErrUnavailable) {
		t.Fatalf("after the grant ended, cut off: %v, want ErrUnavailable", err)
	}

	// Back: the next claim renews; once idle for the pool TTL past its
	// life the grant goes back, and the parent's rate is whole again.
	w.link.cut.Store(false)
	w.clk.Advance(400 * time.Millisecond)
	refills := ts.Stats().Refills
	_, _ = ts.Lease(context.Background(), tierReq(1))
	if ts.Stats().Refills != refills+1 {
		t.Fatalf("no renewal after the cut: %+v", ts.Stats())
	}
	calls = w.link.calls.Load()
	w.clk.Advance(5 * time.Second) // idle past the pool's life
	if w.link.calls.Load() == calls {
		t.Fatal("the idle grant was not given back")
	}
	other.Want, other.Running = remote.GrantUnits, remote.GrantUnits/2
	if g, err := w.parent.Grant(ctx, other); err != nil || g.Share != remote.GrantUnits {
		t.Fatalf("the other holder after the give-back: %+v, %v; want the whole rate", g, err)
	}
}

// offer makes n takes of one token on ts and returns how many it granted.
func offer(t *testing.T, ts *Store, n int) int64 {
	t.Helper()
	var got int64
	for range n {
		res, err := ts.Lease(context.Background(), tierReq(1))
		if err != nil {
			t.Fatal(err)
		}
		got += res.Granted
	}
	return got
}

// TestGrantPoolsDivideByWants: two regions that each offer the whole rate
// hold equal grants (Doorman's proportional share) once both have asked a
// few times, and the world admits its rate, not more.
func TestGrantPoolsDivideByWants(t *testing.T) {
	w := newTierWorld(t)
	a := w.grantRegion(t, "eu", 10*time.Second)
	b := w.grantRegion(t, "us", 10*time.Second)
	step := func() (x, y int64) {
		w.clk.Advance(50 * time.Millisecond)
		return offer(t, a, 5), offer(t, b, 5)
	}
	// Settle: young re-asks every gap, then renewals every 2.5 s.
	for range 120 {
		step()
	}
	var got [2]int64
	for range 40 { // 2 s
		x, y := step()
		got[0] += x
		got[1] += y
	}
	t.Logf("2 s of two regions at the rate each: %v (rate 100/s)", got)
	for r, n := range got {
		if n < 95 || n > 105 {
			t.Errorf("region %d admitted %d in 2 s, want 100 ± 5%% (half the rate)", r, n)
		}
	}
	if sum := got[0] + got[1]; sum > 200+2*12 {
		t.Errorf("the world admitted %d in 2 s, over Rate·2 s plus the grants' bursts", sum)
	}
}

// TestGrantPoolNeedsAGranter: a parent that keeps no grants (a tier's
// Store) leaves grant pools leasing batches; an option out of range is
// refused.
func TestGrantPoolNeedsAGranter(t *testing.T) {
	w := newTierWorld(t)
	mid := w.region(t, "mid", nil)
	ts, err := New("leaf", remote.NewMemory(w.clk), mid, WithClock(w.clk), WithCapacityLeases(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ts.Close() })
	if _, ok := ts.granter(&remote.Request{Limit: tierLimit}, poolReply{st: poolState{renew: 1}}); ok {
		t.Fatal("a parent with no grants taken as a Granter")
	}
	for _, term := range []time.Duration{-time.Second, time.Second} {
		if _, err := New("x", remote.NewMemory(w.clk), w.link, WithCapacityLeases(term)); !errors.Is(err, errConfig) {
			t.Fatalf("WithCapacityLeases(%v): %v", term, err)
		}
	}
}

// TestPoolRecordOfTenFields: a pool record written before grant pools
// (ten fields) reads with the grant's fields 0, so an upgrade does not
// take the records of the old version for corrupt.
func TestPoolRecordOfTenFields(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	mr.Set("{p:k}:pool", "P 7 0 0 0 1 0 0 0 0 0")
	rep, err := redisRecords{c: c}.pool(context.Background(), "{p:k}:pool", poolRead{})
	if err != nil || rep.st.level != 7 || rep.st.renew != 0 {
		t.Fatalf("old record = %+v, %v", rep.st, err)
	}
	mr.Set("{p:k}:pool", "P 7 0 0")
	if _, err := (redisRecords{c: c}).pool(context.Background(), "{p:k}:pool", poolRead{}); !errors.Is(err, remote.ErrCorruptState) {
		t.Fatalf("a record of three fields: %v, want ErrCorruptState", err)
	}
}

// TestGrantRenewalKeepsAccrual: renewals at the same rate go on accruing
// the grant where the last left off, so a pool renewed more often than a
// token accrues still gets its grant's rate; a new rate, or a grant that
// had ended, restarts from the renewal.
func TestGrantRenewalKeepsAccrual(t *testing.T) {
	lim := tierLimit
	gper := grantPer(&lim, 341) // not a whole number of µs per token
	perToken := micros(cdiv(gper, fracUnits))
	grant := func(now micros, gper int64) poolGrant {
		return poolGrant{Share: 341, Gper: gper, Cap: 1000, GrantExp: now + 10_000_000, Renew: now + 1, Exp: now + 10_000_000, Version: 1}
	}
	for _, tc := range []struct {
		name   string
		renew  func(now micros, i int) poolGrant
		tokens func(elapsed micros) int64
	}{
		{"same rate", func(now micros, _ int) poolGrant { return grant(now, gper) },
			func(e micros) int64 { return int64(e) * fracUnits / gper }},
		{"new rate each time", func(now micros, i int) poolGrant { return grant(now, gper+int64(i%2)) },
			func(micros) int64 { return 0 }},
		{"ended", func(now micros, _ int) poolGrant { g := grant(now, gper); g.GrantExp = now + 1; return g },
			func(micros) int64 { return 0 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			now := micros(1_000_000)
			st, _ := applyPool(poolState{}, grant(now, gper), now)
			start := now
			for i := range 200 { // a renewal every third of a token
				now += perToken / 3
				st, _ = applyPool(st, tc.renew(now, i), now)
			}
			if want := tc.tokens(now - start); st.level != want {
				t.Fatalf("after %d µs of renewals a third of a token apart: %d tokens, want %d", now-start, st.level, want)
			}
		})
	}
}
