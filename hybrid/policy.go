package hybrid

import (
	"fmt"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/keys"
	"slices"

	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/remote"
)

// Limit is a token-bucket limit: Burst tokens at most, refilled at Rate
// tokens per Period.
type Limit = local.Limit

// PerSecond returns a Limit of rate per second with Burst = rate.
func PerSecond(rate int64) Limit { return local.PerSecond(rate) }

// PerMinute returns a Limit of rate per minute with Burst = rate.
func PerMinute(rate int64) Limit { return local.PerMinute(rate) }

// PerHour returns a Limit of rate per hour with Burst = rate.
func PerHour(rate int64) Limit { return local.PerHour(rate) }

// Algorithm selects how the store keeps a bucket.
type Algorithm int

const (
	// GCRA is a token bucket kept as exact integers in the store (the zero
	// value): at most Burst + Rate·w/Period admitted in any window w.
	GCRA Algorithm = iota
	// SlidingWindow admits at most Limit.Rate in any interval of length
	// Limit.Period, fleet-wide: the contract "1 000 per hour" audited per
	// window, which a GCRA with Burst 1 000 does not keep (it may let 2 000
	// through in one hour). Burst must equal Rate (0 is read as Rate). The
	// store keeps remote.WindowSlots (100) counters per Period, so a
	// window is exact to Period/100 and never admits more than Rate;
	// leased tokens count until the last moment they may be spent, a hold
	// of Period/100 at most (and at most the lease TTL, see WithLeaseTTL),
	// which costs about 1% of a window's tokens. Shaped policies are not future-dated (no paced grants).
	SlidingWindow
)

// String returns the algorithm's name.
func (a Algorithm) String() string {
	switch a {
	case GCRA:
		return "gcra"
	case SlidingWindow:
		return "sliding-window"
	}
	return fmt.Sprintf("Algorithm(%d)", int(a))
}

// Policy is a named, versioned limit. Every limiter of the fleet that uses
// the same Name shares one bucket per key. A higher Version supersedes a
// lower one everywhere.
type Policy struct {
	Name      string
	Limit     Limit
	Version   uint64
	Algorithm Algorithm
	// Also lists more limits every admission must fit as well, with the
	// same Algorithm: Limit: PerSecond(10), Also: []Limit{PerHour(1000)}
	// is "10 per second and 1 000 per hour". All are decided in one store
	// call on one key; leases are sized by the tightest, and a refusal's
	// Decision names the limit that refused with the longest RetryAfter.
	Also []Limit
	// Tiers are named limits under the same policy, for plans: a key's
	// tier is chosen by WithTier, and a key under no tier (or an unknown
	// one) is under Limit and Also. Tiers are versioned with the policy,
	// so every limiter enforces the same limit for each tier; each tier
	// has buckets of its own, so a key moved to another tier starts under
	// that tier's limit.
	Tiers map[string]Tier
}

// Tier is the limits of one named tier of a Policy.
type Tier struct {
	Limit Limit
	Also  []Limit
}

// Equal reports whether p and q are the same policy, limits and tiers
// included.
func (p Policy) Equal(q Policy) bool {
	if p.Name != q.Name || p.Limit != q.Limit || p.Version != q.Version || p.Algorithm != q.Algorithm ||
		!slices.Equal(p.Also, q.Also) || len(p.Tiers) != len(q.Tiers) {
		return false
	}
	for name, t := range p.Tiers {
		u, ok := q.Tiers[name]
		if !ok || t.Limit != u.Limit || !slices.Equal(t.Also, u.Also) {
			return false
		}
	}
	return true
}

// normalized returns p with a sliding window's Burst 0 read as its Rate.
func (p Policy) normalized() Policy {
	if p.Algorithm != SlidingWindow {
		return p
	}
	fix := func(l Limit) Limit {
		if l.Burst == 0 {
			l.Burst = l.Rate
		}
		return l
	}
	fixAll := func(ls []Limit) []Limit {
		if ls == nil {
			return nil
		}
		out := make([]Limit, len(ls))
		for i, l := range ls {
			out[i] = fix(l)
		}
		return out
	}
	p.Limit, p.Also = fix(p.Limit), fixAll(p.Also)
	if p.Tiers != nil {
		tiers := make(map[string]Tier, len(p.Tiers))
		for name, t := range p.Tiers {
			tiers[name] = Tier{Limit: fix(t.Limit), Also: fixAll(t.Also)}
		}
		p.Tiers = tiers
	}
	return p
}

// Sentinel errors, matched with errors.Is. Store failures are not among
// them: they change the Mode instead.
var (
	// ErrInvalidKey: empty key, key over 1 KiB, or a prefix with braces.
	ErrInvalidKey = remote.ErrInvalidKey
	// ErrInvalidN: n ≤ 0.
	ErrInvalidN = local.ErrInvalidN
	// ErrExceedsBurst: n > Burst, which can never be admitted.
	ErrExceedsBurst = local.ErrExceedsBurst
	// ErrInvalidLimit: a Limit that cannot be enforced exactly.
	ErrInvalidLimit = local.ErrInvalidLimit
	// ErrInvalidPolicy: empty or overlong name, unsupported algorithm,
	// version 0 given to SetPolicy, or a version too large to store.
	ErrInvalidPolicy = remote.ErrInvalidPolicy
	// ErrStalePolicy: SetPolicy with a version not above the one in force.
	ErrStalePolicy = errs.New("hybrid", "stale policy version")
	// ErrClosed: the limiter was closed.
	ErrClosed = errs.New("hybrid", "limiter closed")
	// ErrInvalidOption: an option New cannot work with (a non-positive
	// duration, a nil clock or logger, a prefix with braces, ...).
	ErrInvalidOption = errs.New("hybrid", "invalid option")
)

// Validate reports whether New and SetPolicy accept p (a sliding window's
// Burst 0 read as its Rate): nil, or an error wrapping ErrInvalidPolicy or
// ErrInvalidLimit.
func (p Policy) Validate() error { return validatePolicy(p.normalized()) }

// validatePolicy checks a normalized policy.
func validatePolicy(p Policy) error {
	if err := keys.Validate("", p.Name, "k"); err != nil {
		return errs.Errorf("hybrid", "policy %q: %w", p.Name, err)
	}
	if p.Algorithm != GCRA && p.Algorithm != SlidingWindow {
		return errs.Errorf("hybrid", "policy %q: %w: algorithm %v is not supported", p.Name, ErrInvalidPolicy, p.Algorithm)
	}
	if p.Version > remote.MaxVersion {
		return errs.Errorf("hybrid", "policy %q: %w: version %d above %d", p.Name, ErrInvalidPolicy, p.Version, remote.MaxVersion)
	}
	if err := p.record().Validate(); err != nil {
		return errs.Errorf("hybrid", "policy %q: %w", p.Name, err)
	}
	return nil
}

// record is p as the store keeps it.
func (p Policy) record() remote.PolicyRecord {
	rec := remote.PolicyRecord{Version: max(p.Version, 1), Limit: p.Limit, Window: p.Algorithm == SlidingWindow,
		Also: p.Also}
	for name, t := range p.Tiers {
		if rec.Tiers == nil {
			rec.Tiers = make(map[string]remote.TierRecord, len(p.Tiers))
		}
		rec.Tiers[name] = remote.TierRecord{Limit: t.Limit, Also: t.Also}
	}
	return rec
}

// policyFrom is the policy named name that rec holds.
func policyFrom(name string, rec remote.PolicyRecord) Policy {
	p := Policy{Name: name, Limit: rec.Limit, Version: rec.Version, Also: rec.Also}
	if rec.Window {
		p.Algorithm = SlidingWindow
	}
	for tier, t := range rec.Tiers {
		if p.Tiers == nil {
			p.Tiers = make(map[string]Tier, len(rec.Tiers))
		}
		p.Tiers[tier] = Tier{Limit: t.Limit, Also: t.Also}
	}
	return p
}
