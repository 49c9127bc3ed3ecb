package tiered

import (
	"context"
	"errors"
	"hash/fnv"
	"math"
	"math/big"
	"strconv"
	"time"

	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/remote"
)

// Capacity leases, one level up (WithCapacityLeases). A pool whose key has
// sustained demand holds a capacity grant from the parent instead of
// leasing batches: a share of the world's rate and a burst, for a term on
// the parent's clock (see remote.Granter). The pool then refills itself at
// the grant's rate in the region's own store until a margin before the
// term ends, and the region calls the parent only to renew, a few times a
// term, with the demand it measured. The parent divides its rate among
// the regions that hold grants by their wants (Doorman's proportional
// share, as among processes), so regions with equal demand get equal
// parts; and it refills everyone else with what the grants leave, so a
// region cut off from the parent keeps admitting exactly by its grant
// until the term ends, with nothing to charge later, and only then falls
// to its processes' outage mode.

// WithCapacityLeases makes the region's pools of plain token buckets hold
// capacity grants from the parent, each for term (renewed every quarter
// of it), once their key's demand is at least 1/32 of its rate. The parent
// must be a remote.Granter (a *remote.RedisStore or *remote.MemoryStore);
// sliding windows and several limits keep leasing batches. The term is
// the longest cut from the parent the bound survives without an excess to
// pay back, and also how long a region that stopped taking keeps its
// share reserved at most (a pool idle for the pool TTL gives its grant
// back at once; a region whose every process crashed cannot). 0, the
// default, leases batches only; a term must be at least 8 refill gaps.
func WithCapacityLeases(term time.Duration) Option {
	return optionFunc(func(c *config) { c.term = term })
}

const (
	// grantMinPart is the least demand worth a grant: 1/32 of the rate,
	// half an even part among the 16 holders a bucket keeps by default.
	grantMinPart = 32
	// grantHeadroom is how much above its measured demand a region asks.
	grantHeadroom = 1.25
	// grantRenewals is how many grant calls a term spans.
	grantRenewals = 4
)

// grantHolder is the region's holder name at the parent: "region." and
// the region's name, or a hash of it for a name the parent does not take.
func grantHolder(region string) string {
	h := "region." + region
	ok := len(h) <= 64
	for i := 0; ok && i < len(region); i++ {
		c := region[i]
		ok = c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == ':' || c == '-'
	}
	if ok {
		return h
	}
	f := fnv.New64a()
	_, _ = f.Write([]byte(region))
	return "region.h" + strconv.FormatUint(f.Sum64(), 16)
}

// granter returns the parent as a Granter if the pool of r may hold a
// grant: grants are on, r is a plain token bucket the parent has not
// refused grants for at r's version, and the pool holds one already or
// its demand since the last refill is at least 1/grantMinPart of the rate.
func (t *Store) granter(r *remote.Request, rep poolReply) (remote.Granter, bool) {
	g, ok := t.parent.(remote.Granter)
	if !ok || t.cfg.term <= 0 || r.Window || len(r.Also) > 0 {
		return nil, false
	}
	if v, off := t.noGrants.Load(r.Prefix + "\x00" + r.Policy); off && v.(uint64) == r.Version {
		return nil, false
	}
	if rep.st.renew > 0 {
		return g, true
	}
	return g, demandOf(rep) >= max(perSecond(&r.Limit)/grantMinPart, 1)
}

// perSecond is lim's rate in tokens per second.
func perSecond(lim *local.Limit) float64 { return float64(lim.Rate) / lim.Period.Seconds() }

// demandOf is the pool's demand since its last refill, in tokens per
// second: what it granted and what it could not.
func demandOf(rep poolReply) float64 {
	elapsed := rep.now - rep.st.at
	if rep.st.at <= 0 || elapsed <= 0 {
		return 0
	}
	return float64(rep.st.used) / elapsed.duration().Seconds()
}

// grantRequest is the grant call for the pool of r, whose take rep
// claimed it: the region's demand with headroom as its want (at most half
// the rate on a first call, while the others' wants are not known), the
// share it spends now as running.
func (t *Store) grantRequest(r *remote.Request, rep poolReply) remote.GrantRequest {
	lim := r.Limit
	want := int64(math.Ceil(demandOf(rep) * grantHeadroom / perSecond(&lim) * remote.GrantUnits))
	if rep.st.asks == 0 {
		want = min(want, remote.GrantUnits/2)
	}
	pr := *r
	pr.N, pr.Min, pr.Need, pr.MaxDelay, pr.Since = 0, 0, 0, 0, time.Time{}
	req := remote.GrantRequest{Request: pr, Holder: t.holder, Want: min(max(want, 1), remote.GrantUnits),
		Term: t.cfg.term,
		// An eighth of Burst: the bucket keeps half for those without a
		// grant with four regions holding one.
		Burst: max(lim.Burst/8, 1)}
	if rep.st.live(rep.now) && rep.st.ver == r.Version {
		req.Running = rep.st.share
	}
	return req
}

// grantRefill makes the grant call of the pool at key, claimed by take
// rep, and deposits the answer; false if the parent takes no grants for
// r's limit (the caller leases a batch instead).
func (t *Store) grantRefill(g remote.Granter, r remote.Request, key string, rep poolReply) bool {
	pctx, cancel := context.WithTimeout(t.ctx, t.cfg.timeout)
	defer cancel()
	req := t.grantRequest(&r, rep)
	t.parentCalls.Add(1)
	start := t.cfg.clk.Now()
	silent := t.markSilent(key)
	gr, err := g.Grant(pctx, req)
	marked := silent()
	ctx, cancelLocal := context.WithTimeout(t.ctx, t.cfg.timeout) // as in refill
	defer cancelLocal()
	switch {
	case errors.Is(err, remote.ErrNoGrants):
		t.noGrants.Store(r.Prefix+"\x00"+r.Policy, r.Version)
		if rep.st.renew > 0 {
			_, _ = t.recs.pool(ctx, key, poolGrant{Exp: rep.st.exp, Version: rep.st.ver, Rem: rep.st.rem})
		}
		return false
	case err != nil:
		t.failures.Add(1)
		if !marked {
			_, _ = t.recs.pool(ctx, key, poolFail{})
		}
		return true
	}
	t.rttMicros.Store(max(t.cfg.clk.Now().Sub(start).Microseconds(), 1))
	if gr.Version > rep.st.ver || gr.Stale {
		t.copyPolicy(ctx, r.Prefix, r.Policy)
	}
	if gr.Stale {
		return true // the next take, at the newer version, calls again
	}
	renew := t.renewAfter(req, gr, rep)
	life := max(renew, microsOf(t.cfg.gap)) + microsOf(t.cfg.poolTTL)
	put := poolGrant{Share: gr.Share, Gper: grantPer(&r.Limit, gr.Share), Cap: gr.Burst, Tokens: gr.Tokens,
		// The parent's expiry is its TIME at the call plus the term, read
		// after the request left, and rep.now was read before: stop a
		// margin before the term counted from then (clock rates drift by
		// parts per million).
		GrantExp: rep.now + microsOf(gr.Term-gr.Term/100-time.Millisecond),
		Renew:    rep.now + max(renew, 1), Exp: rep.now + life,
		Version: gr.Version, Rem: gr.Remaining, Reset: microsOf(gr.ResetAfter)}
	if gr.Term <= 0 {
		put.Gper, put.GrantExp = 0, 0 // kept waiting with no share
	}
	got, err := t.recs.pool(ctx, key, put)
	if err != nil {
		return true // the grant's tokens are lost to everyone; it ends at its term
	}
	if got.granted > 0 {
		t.returnToParent(ctx, r, key, got.granted, 0) // tokens of an older version
	}
	t.refills.Add(1)
	t.leased.Add(gr.Tokens)
	t.giveBackAfter(r, key, life.duration())
	return true
}

// renewAfter is how long after the claim of rep the pool's next grant
// call is due, given answer gr to req: at once when the share was lowered
// (the parent counts the region at what it says it runs at until told);
// a refill gap while the grant is young (youngAsks), for one more answer
// while above an even part, and while kept waiting with none, so the
// regions settle their shares within a few gaps; an eighth of the
// term when short of both its want and an even part; else a quarter.
func (t *Store) renewAfter(req remote.GrantRequest, gr remote.Grant, rep poolReply) micros {
	part := remote.GrantUnits / int64(max(gr.Holders, 1))
	asks, young := rep.st.asks+1, t.youngAsks()
	switch {
	case gr.Share < req.Running:
		return 0
	case gr.Share == 0 || asks <= young || (asks <= young+1 && gr.Share > part):
		return microsOf(t.cfg.gap)
	case gr.Share < req.Want && gr.Share < part:
		return microsOf(t.cfg.term / (2 * grantRenewals))
	}
	return microsOf(t.cfg.term / grantRenewals)
}

// youngAsks is how many answers a new grant renews a refill gap after:
// those of the first eighth of the term, at least two. A first answer
// cannot know the wants of regions that have not asked yet, and regions
// that start together do not ask together: one whose processes started
// a second late, or whose first batches lasted longer, asks after the
// others took the whole rate, and it gets its part only when they renew
// (with two young answers, 27% of the world's against 39% for another
// in a loaded run of TestRegionsDivideByWantsWithGrants).
func (t *Store) youngAsks() int64 {
	return max(int64(t.cfg.term/(8*max(t.cfg.gap, time.Millisecond))), 2)
}

// grantPer is the time per token of a share of lim's rate, in
// 1/fracUnits µs, rounded up so the pool never accrues faster than the
// grant; 0 for no share.
func grantPer(lim *local.Limit, share int64) int64 {
	if share <= 0 || lim.Rate <= 0 {
		return 0
	}
	num := new(big.Int).Mul(big.NewInt(lim.Period.Microseconds()), big.NewInt(remote.GrantUnits*fracUnits))
	den := new(big.Int).Mul(big.NewInt(lim.Rate), big.NewInt(share))
	q, m := new(big.Int).QuoRem(num, den, new(big.Int))
	if m.Sign() > 0 {
		q.Add(q, big.NewInt(1))
	}
	if !q.IsInt64() || q.Int64() >= 1<<50 {
		return 1 << 50 // slower than a token in 30 years: none
	}
	return max(q.Int64(), 1)
}

// ungrant gives the grant of the pool at key back to the parent, with the
// n tokens its drain took out.
func (t *Store) ungrant(ctx context.Context, r remote.Request, key string, n int64) {
	g, ok := t.parent.(remote.Granter)
	if !ok {
		return
	}
	pr := r
	pr.N, pr.Min, pr.Need, pr.MaxDelay, pr.Since = 0, 0, 0, 0, time.Time{}
	t.parentCalls.Add(1)
	if _, err := g.Ungrant(ctx, remote.GrantRequest{Request: pr, Holder: t.holder}, n); err != nil {
		t.failures.Add(1) // the grant ends at its term; its tokens are lost to everyone
		return
	}
	t.givenBack.Add(n)
}

// grantRetry is the wait a grant pool's refusal names: until need tokens
// have accrued at the grant's rate, at least a millisecond.
func grantRetry(st *poolState, need int64) time.Duration {
	short := max(need, 1) - st.level
	wait := micros(cdiv(max(short, 1)*st.gper, fracUnits))
	return max(wait.duration(), time.Millisecond)
}
