// Package keys builds every Redis key leasehold writes, and checks the names
// that go into them. It is the one place where the rules below are kept;
// FuzzKeys (keys_test.go) holds every kind of key to them.
//
// The rules:
//   - Every key is prefix{tag}suffix. The tag is the only braced part, so
//     Redis Cluster hashes exactly the tag: all keys of one bucket share a
//     slot, and all internal keys of one policy share the policy's slot.
//   - User input never moves a key to another slot or another policy:
//     '{', '}' and '%' are escaped everywhere, and ':' in a policy or tier
//     name, so the first ':' inside a tag always ends the policy (and tier)
//     and no (policy, tier, key) triple shares a tag with another.
//   - A tier is written policy%~tier; escaping never writes '%' before '~',
//     so no tier's tag equals another policy's.
//   - Bucket keys (plain and shaped buckets share one) end in '}'; every
//     other key ends in '}:' and the name of its kind, so no user key can
//     collide with an internal key, and no internal kind with another.
//   - A prefix holds no brace.
package keys

import (
	"fmt"
	"github.com/leasehold/leasehold/internal/errs"
	"strings"
	"unicode/utf8"
)

// Sentinels re-exported by package remote, which owns them in the API.
var (
	ErrInvalidKey    = errs.New("remote", "invalid key")
	ErrInvalidPolicy = errs.New("remote", "invalid policy")
)

const (
	// MaxKeyLen is the longest user key accepted, in bytes.
	MaxKeyLen = 1024
	// MaxPolicyNameLen is the longest policy name accepted, in bytes.
	MaxPolicyNameLen = 256
	// MaxTierLen is the longest tier name accepted, in bytes.
	MaxTierLen = 64
	// DefaultPrefix is put in front of every key unless a caller names
	// another.
	DefaultPrefix = "leasehold:"
)

// The kinds of internal keys, the suffix after "}:".
const (
	kindPolicy      = "policy"       // the current policy record (a string)
	kindFleet       = "fleet"        // live limiters of a policy (a sorted set)
	kindWorld       = "world"        // region weights at a parent store (a hash)
	kindRegion      = "region"       // a region's copy of the world's weight and its beat claim
	kindPool        = "pool"         // a region's pool for one bucket
	kindGrants      = "grants"       // a bucket's capacity grants
	kindSlots       = "slots"        // a concurrency limit's slots, by holder (a hash)
	kindSlotsPolicy = "slots-policy" // a concurrency limit's policy record (a string)
)

// Bucket returns the key of a bucket, prefix{policy:key}, or under a tier
// prefix{policy%~tier:key}. Plain and shaped buckets (sliding windows,
// several limits) share it: the value says which it is.
func Bucket(prefix, policy, tier, key string) string {
	return bucketTag(prefix, policy, tier, key, "")
}

// Pool returns the key of a region's pool for a bucket: the bucket's tag,
// so the pool lives in the bucket's slot, then ":pool".
func Pool(prefix, policy, tier, key string) string {
	return bucketTag(prefix, policy, tier, key, "}:"+kindPool)
}

// Grants returns the key of a bucket's capacity grants: the bucket's tag,
// so both live in one slot and one script keeps them, then ":grants".
func Grants(prefix, policy, tier, key string) string {
	return bucketTag(prefix, policy, tier, key, "}:"+kindGrants)
}

// BucketAndGrants returns Bucket and Grants of the same arguments from one
// string: the grants key is the bucket key then ":grants", so the bucket
// key is its head. A store call sends both, and builds one string, not
// two.
func BucketAndGrants(prefix, policy, tier, key string) (bucket, grants string) {
	grants = Grants(prefix, policy, tier, key)
	return grants[:len(grants)-len(":"+kindGrants)], grants
}

// Slots returns the key of a concurrency limit's slots for key, by holder:
// the bucket's tag, then ":slots".
func Slots(prefix, policy, tier, key string) string {
	return bucketTag(prefix, policy, tier, key, "}:"+kindSlots)
}

// Policy returns the key of a policy's current record.
func Policy(prefix, policy string) string { return internal(prefix, policy, kindPolicy) }

// Fleet returns the key of the sorted set of a policy's live limiters.
func Fleet(prefix, policy string) string { return internal(prefix, policy, kindFleet) }

// World returns the key of the hash of region weights of a policy, kept by
// the parent store of tiers of stores.
func World(prefix, policy string) string { return internal(prefix, policy, kindWorld) }

// Region returns the key where a region keeps the world's weight of a
// policy and its beat claim.
func Region(prefix, policy string) string { return internal(prefix, policy, kindRegion) }

func bucketTag(prefix, policy, tier, key, end string) string {
	if prefix == "" {
		prefix = DefaultPrefix
	}
	if end == "" {
		end = "}"
	}
	var b strings.Builder
	b.Grow(len(prefix) + len(policy) + len(tier) + len(key) + len(end) + 4)
	b.WriteString(prefix)
	b.WriteByte('{')
	escape(&b, policy, true)
	if tier != "" {
		b.WriteString("%~")
		escape(&b, tier, true)
	}
	b.WriteByte(':')
	escape(&b, key, false)
	b.WriteString(end)
	return b.String()
}

func internal(prefix, policy, kind string) string {
	if prefix == "" {
		prefix = DefaultPrefix
	}
	var b strings.Builder
	b.WriteString(prefix)
	b.WriteByte('{')
	escape(&b, policy, true)
	b.WriteString("}:")
	b.WriteString(kind)
	return b.String()
}

func escape(b *strings.Builder, s string, colon bool) {
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '%':
			b.WriteString("%25")
		case c == '{':
			b.WriteString("%7B")
		case c == '}':
			b.WriteString("%7D")
		case c == ':' && colon:
			b.WriteString("%3A")
		default:
			b.WriteByte(c)
		}
	}
}

// Validate reports whether prefix, policy and key can name a bucket.
func Validate(prefix, policy, key string) error {
	switch {
	case key == "":
		return fmt.Errorf("%w: empty key", ErrInvalidKey)
	case len(key) > MaxKeyLen:
		return fmt.Errorf("%w: key of %d bytes, limit %d", ErrInvalidKey, len(key), MaxKeyLen)
	}
	return ValidateNames(prefix, policy)
}

// ValidateNames reports whether prefix and policy can name a policy's
// keys.
func ValidateNames(prefix, policy string) error {
	switch {
	case policy == "":
		return fmt.Errorf("%w: empty name", ErrInvalidPolicy)
	case len(policy) > MaxPolicyNameLen || !utf8.ValidString(policy):
		return fmt.Errorf("%w: name %.40q is not UTF-8 of at most %d bytes", ErrInvalidPolicy, policy, MaxPolicyNameLen)
	case strings.ContainsAny(prefix, "{}"):
		return fmt.Errorf("%w: prefix %q contains a brace", ErrInvalidKey, prefix)
	}
	return nil
}

// ValidateTier reports whether name can name a tier: "" (none), or 1 to
// MaxTierLen letters, digits, '.', '_' or '-'.
func ValidateTier(name string) error {
	if len(name) > MaxTierLen {
		return fmt.Errorf("%w: tier name of %d bytes, limit %d", ErrInvalidPolicy, len(name), MaxTierLen)
	}
	for i := 0; i < len(name); i++ {
		switch c := name[i]; {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == '-':
		default:
			return fmt.Errorf("%w: tier %q: only letters, digits, '.', '_' and '-'", ErrInvalidPolicy, name)
		}
	}
	return nil
}

// SlotsPolicy returns the key of a concurrency limit's policy record.
func SlotsPolicy(prefix, policy string) string { return internal(prefix, policy, kindSlotsPolicy) }
