package main

import (
	"fmt"
	"slices"
	"time"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/local"
)

// starveBin is how finely the verdict looks for stretches the fleet
// admitted too little.
const starveBin = 100 * time.Millisecond

// starveBins counts, per bin, what the fleet admitted and what an ideal
// limiter would have: one exact limiter per key (a token bucket, or a
// sliding log for a sliding window; every limit of the key), fed every
// offer. A fleet that admits under half of that for a second or more is
// paying back, or shut out; the verdict says so.
type starveBins struct {
	admitted, ideal []int64
	keys            map[string]*idealKey
	limits          []hybrid.Limit // in force
	window          bool
	// off: the scenario settles costs after the work, which an ideal fed
	// the estimates does not model.
	off bool
}

// idealKey is one key's exact limiter, under the limits it was made for.
type idealKey struct {
	limits  []hybrid.Limit
	buckets []*local.Bucket
	log     []time.Duration // sliding window: admissions, oldest first
}

func (k *idealKey) take(now time.Duration, n int64, window bool) bool {
	if window {
		// Every limit is a window: at most Rate in any Period.
		var longest time.Duration
		for _, l := range k.limits {
			longest = max(longest, l.Period)
			i, _ := slices.BinarySearch(k.log, now-l.Period+1)
			if int64(len(k.log)-i)+n > l.Rate {
				return false
			}
		}
		i, _ := slices.BinarySearch(k.log, now-longest+1)
		k.log = k.log[i:]
		for range n {
			k.log = append(k.log, now)
		}
		return true
	}
	for _, b := range k.buckets {
		if b.Tokens(int64(now)) < n {
			return false
		}
	}
	for _, b := range k.buckets {
		if _, err := b.TakeAt(int64(now), n); err != nil {
			return false
		}
	}
	return true
}

func (b *starveBins) grow(bin int) {
	for len(b.admitted) <= bin {
		b.admitted = append(b.admitted, 0)
		b.ideal = append(b.ideal, 0)
	}
}

// setLimits makes every key's ideal limiter follow a policy or tier
// change from now on.
func (b *starveBins) setLimits(limits []hybrid.Limit, window bool) {
	b.limits, b.window = limits, window
}

func (b *starveBins) offer(now time.Duration, key string, n int64) {
	bin := int(now / starveBin)
	b.grow(bin)
	if b.keys == nil {
		b.keys = map[string]*idealKey{}
	}
	k := b.keys[key]
	if k == nil || !slices.Equal(k.limits, b.limits) {
		k = &idealKey{limits: b.limits}
		for _, l := range b.limits {
			if bk, err := local.NewBucket(l); err == nil {
				k.buckets = append(k.buckets, bk)
			}
		}
		b.keys[key] = k
	}
	if k.take(now, n, b.window) {
		b.ideal[bin] += n
	}
}

func (b *starveBins) admit(now time.Duration, n int64) {
	bin := int(now / starveBin)
	b.grow(bin)
	b.admitted[bin] += n
}

// starvedMin is the shortest stretch the verdict names.
const starvedMin = time.Second

// starved names the stretches of at least starvedMin in which the fleet
// admitted less than half of what the ideal limiter did, e.g. "0 admitted
// (ideal 2 400) for 2.5 s at 25.0–27.5 s".
func (b *starveBins) starved() []string {
	if b.off {
		return nil
	}
	var out []string
	from, sum, ideal := -1, int64(0), int64(0)
	flush := func(to int) {
		if from >= 0 && time.Duration(to-from)*starveBin >= starvedMin && 2*sum < ideal {
			out = append(out, fmt.Sprintf("%d admitted (an exact limiter: %d) for %.1f s at %.1f–%.1f s", sum, ideal,
				(time.Duration(to-from)*starveBin).Seconds(), (time.Duration(from)*starveBin).Seconds(), (time.Duration(to)*starveBin).Seconds()))
		}
		from, sum, ideal = -1, 0, 0
	}
	for i := range b.admitted {
		// A bin is low when the fleet admitted under half of the ideal;
		// bins where the ideal admitted nothing neither start nor end a
		// stretch.
		low := 2*b.admitted[i] < b.ideal[i]
		switch {
		case low && from < 0:
			from, sum, ideal = i, b.admitted[i], b.ideal[i]
		case low || from >= 0 && b.ideal[i] == 0 && b.admitted[i] == 0:
			sum, ideal = sum+b.admitted[i], ideal+b.ideal[i]
		default:
			flush(i)
		}
	}
	flush(len(b.admitted))
	return out
}
