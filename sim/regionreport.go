package main

import (
	"fmt"
	"io"
	"math"
	"text/tabwriter"
	"time"
)

// regionStats is what one region of a tiered world did.
type regionStats struct {
	offered, admitted int64
	// inFault is what the region admitted while its link (or every
	// link) was cut.
	inFault int64
	perS    []int64 // [second] admitted
	offS    []int64 // [second] offered
}

// regionDecision records a decision of a process of region ri.
func (r *recorder) regionDecision(now time.Duration, ri int, allowed bool) {
	if len(r.sc.Regions) == 0 {
		return
	}
	if r.regions == nil {
		r.regions = make([]regionStats, len(r.sc.Regions))
		for i := range r.regions {
			r.regions[i].perS = make([]int64, len(r.perSecond))
			r.regions[i].offS = make([]int64, len(r.perSecond))
		}
	}
	rs := &r.regions[ri]
	rs.offered++
	rs.offS[min(int(now/time.Second), len(rs.offS)-1)]++
	if !allowed {
		return
	}
	rs.admitted++
	rs.perS[min(int(now/time.Second), len(rs.perS)-1)]++
	if f, ok := r.linkFault(ri); ok && now >= f[0] && now < f[1] {
		rs.inFault++
	}
	r.worldAdmits = append(r.worldAdmits, now)
}

// linkFault returns the first link event that cuts region ri off.
func (r *recorder) linkFault(ri int) ([2]time.Duration, bool) {
	for _, e := range r.sc.Events {
		if e.Kind == "link" && (e.Region == "" || e.Region == r.sc.Regions[ri].Name) {
			return [2]time.Duration{sec(e.AtS), sec(e.UntilS)}, true
		}
	}
	return [2]time.Duration{}, false
}

// share is region ri's part of the policy's limit over d: its processes
// of the world's (the weight a Tiered store reports).
func (r *recorder) share(ri int, d time.Duration) float64 {
	return float64(r.sc.Policy.limit().TokensIn(d)) * float64(r.sc.Regions[ri].Processes) / float64(r.sc.Processes)
}

// worldOver is the most the world's admissions ran over Burst + Rate·t
// since the start, in tokens (negative: under it all along).
func (r *recorder) worldOver() float64 {
	lim := r.sc.Policy.limit()
	worst := -float64(lim.Burst)
	for k, t := range r.worldAdmits {
		bound := float64(lim.Burst) + float64(lim.Rate)*float64(t)/float64(lim.Period)
		worst = math.Max(worst, float64(k+1)-bound)
	}
	return worst
}

// parentCallsPerS is region ri's calls to the world's store per virtual
// second over the run.
func (r *recorder) parentCallsPerS(ri int) float64 {
	return float64(r.w.regions[ri].link.calls.Load()) / r.sc.DurationS
}

// regionTable writes one row per region of a tiered world, and the
// world's worst excess over its exact bound.
func (r *recorder) regionTable(out io.Writer) {
	if len(r.regions) == 0 {
		return
	}
	fmt.Fprintln(out, "\nregions:")
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "region\tprocesses\toffered\tadmitted\tof the world %\tcut off: admitted\tshare\tparent calls/s\t")
	var all int64
	for _, rs := range r.regions {
		all += rs.admitted
	}
	for i, rs := range r.regions {
		cut, share := "-", "-"
		if f, ok := r.linkFault(i); ok {
			cut, share = fmt.Sprint(rs.inFault), fmt.Sprintf("%.0f", r.share(i, f[1]-f[0]))
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%.1f\t%s\t%s\t%.2f\t\n", r.sc.Regions[i].Name, r.sc.Regions[i].Processes,
			rs.offered, rs.admitted, pct(rs.admitted, all), cut, share, r.parentCallsPerS(i))
	}
	_ = tw.Flush()
	if lag, ok := r.followLag(); ok {
		fmt.Fprintf(out, "admissions follow demand: worst lag %v (by cross-correlation of each region's admitted and offered per second)\n", lag)
	}
	lim := r.sc.Policy.limit()
	if over := r.worldOver(); over > 0 {
		fmt.Fprintf(out, "world: %d admitted; most over Burst + Rate·t at any moment: %.0f (Burst %d)\n", all, over, lim.Burst)
	} else {
		fmt.Fprintf(out, "world: %d admitted; never over Burst + Rate·t (closest: %.0f under; Burst %d)\n", all, -over, lim.Burst)
	}
}

// followLag is, for a tiered world whose regions' demands move apart
// (a traffic source per region), the worst lag over its regions between
// what a region was offered and what it admitted: the shift of the
// offered per-second series, 0 to 15 s, that correlates best with the
// admitted one. false for a world whose regions share one source.
func (r *recorder) followLag() (time.Duration, bool) {
	perRegion := false
	for _, tr := range r.sc.Traffic {
		perRegion = perRegion || tr.Region != ""
	}
	if !perRegion {
		return 0, false
	}
	var worst time.Duration
	for _, rs := range r.regions {
		best, bestCorr := 0, math.Inf(-1)
		for shift := 0; shift <= 15 && shift < len(rs.perS)/2; shift++ {
			if c := correlation(rs.perS[shift:], rs.offS[:len(rs.offS)-shift]); c > bestCorr {
				best, bestCorr = shift, c
			}
		}
		worst = max(worst, time.Duration(best)*time.Second)
	}
	return worst, true
}

// correlation is Pearson's correlation of two series of equal length.
func correlation(a, b []int64) float64 {
	n := float64(len(a))
	var sa, sb float64
	for i := range a {
		sa += float64(a[i])
		sb += float64(b[i])
	}
	ma, mb := sa/n, sb/n
	var cov, va, vb float64
	for i := range a {
		da, db := float64(a[i])-ma, float64(b[i])-mb
		cov += da * db
		va += da * da
		vb += db * db
	}
	if va == 0 || vb == 0 {
		return 0
	}
	return cov / math.Sqrt(va*vb)
}

// regionMisses checks a tiered world's targets.
func (r *recorder) regionMisses() []string {
	if len(r.regions) == 0 {
		return nil
	}
	t := r.sc.Targets
	var miss []string
	for i := range r.regions {
		if c := r.parentCallsPerS(i); t.MaxParentCallsPerSPerRegion > 0 && c > t.MaxParentCallsPerSPerRegion {
			miss = append(miss, fmt.Sprintf("region %s: %.2f parent calls/s > %.2f", r.sc.Regions[i].Name, c, t.MaxParentCallsPerSPerRegion))
		}
		if f, ok := r.linkFault(i); ok && t.RegionShareWithinPct > 0 {
			share := r.share(i, f[1]-f[0])
			if d := 100 * math.Abs(float64(r.regions[i].inFault)-share) / share; d > t.RegionShareWithinPct {
				miss = append(miss, fmt.Sprintf("region %s admitted %d cut off, share %.0f: %.1f%% off > %.1f%%",
					r.sc.Regions[i].Name, r.regions[i].inFault, share, d, t.RegionShareWithinPct))
			}
		}
	}
	if lag, ok := r.followLag(); ok && t.FollowLagMaxS > 0 && lag.Seconds() > t.FollowLagMaxS {
		miss = append(miss, fmt.Sprintf("admissions lag demand by %v > %.1f s", lag, t.FollowLagMaxS))
	}
	if t.RegionSplitWithinPts > 0 {
		var all int64
		for _, rs := range r.regions {
			all += rs.admitted
		}
		for i, rs := range r.regions {
			part := 100 * float64(r.sc.Regions[i].Processes) / float64(r.sc.Processes)
			if d := pct(rs.admitted, all) - part; math.Abs(d) > t.RegionSplitWithinPts {
				miss = append(miss, fmt.Sprintf("region %s: %.1f%% of the world's admissions, its part %.1f%%: %+.1f pts > %.1f",
					r.sc.Regions[i].Name, pct(rs.admitted, all), part, d, t.RegionSplitWithinPts))
			}
		}
	}
	if t.WorldOverMaxBursts != nil {
		lim := r.sc.Policy.limit()
		if o := r.worldOver(); o > *t.WorldOverMaxBursts*float64(lim.Burst) {
			miss = append(miss, fmt.Sprintf("world %+.0f over Burst + Rate·t > %.2f Burst", o, *t.WorldOverMaxBursts))
		}
	}
	return miss
}
