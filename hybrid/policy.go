package hybrid

import (
	"errors"
	"fmt"

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
	// value, and the only algorithm implemented so far).
	GCRA Algorithm = iota
	// SlidingWindow is reserved; New and SetPolicy reject it with
	// ErrInvalidPolicy until it is implemented.
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
	ErrStalePolicy = errors.New("hybrid: stale policy version")
	// ErrClosed: the limiter was closed.
	ErrClosed = errors.New("hybrid: limiter closed")
	// ErrInvalidOption: an option New cannot work with (a non-positive
	// duration, a nil clock or logger, a prefix with braces, ...).
	ErrInvalidOption = errors.New("hybrid: invalid option")
)

func validatePolicy(p Policy) error {
	if err := remote.ValidateKey("", p.Name, "k"); err != nil {
		return fmt.Errorf("hybrid: policy %q: %w", p.Name, err)
	}
	if p.Algorithm != GCRA {
		return fmt.Errorf("hybrid: policy %q: %w: algorithm %v is not supported", p.Name, ErrInvalidPolicy, p.Algorithm)
	}
	if p.Version > remote.MaxVersion {
		return fmt.Errorf("hybrid: policy %q: %w: version %d above %d", p.Name, ErrInvalidPolicy, p.Version, remote.MaxVersion)
	}
	if err := p.Limit.Validate(); err != nil {
		return fmt.Errorf("hybrid: policy %q: %w", p.Name, err)
	}
	return nil
}
