package remote

import "strings"

// BucketKey returns the Redis key of a bucket: prefix{policy:key}. The hash
// tag is the whole braced part, so every bucket of a key lives in one slot,
// and escaping guarantees that:
//   - braces in user input cannot end the tag early or open a new one;
//   - ':' in a policy name is escaped, so the first ':' inside the tag always
//     separates policy from key and no (policy, key) pair collides with
//     another;
//   - bucket keys end in '}', internal keys (PolicyKey, FleetKey) in '}:…',
//     so user keys never collide with internal ones.
func BucketKey(prefix, policy, key string) string { return TierBucketKey(prefix, policy, "", key) }

// TierBucketKey returns the Redis key of a bucket under a tier of a policy:
// prefix{policy%~tier:key}, or BucketKey's form for tier "". Escaping never
// writes '%' before '~', so no tier's key collides with another policy's.
func TierBucketKey(prefix, policy, tier, key string) string {
	if prefix == "" {
		prefix = DefaultPrefix
	}
	var b strings.Builder
	b.Grow(len(prefix) + len(policy) + len(tier) + len(key) + 5)
	b.WriteString(prefix)
	b.WriteByte('{')
	escape(&b, policy, true)
	if tier != "" {
		b.WriteString("%~")
		escape(&b, tier, true)
	}
	b.WriteByte(':')
	escape(&b, key, false)
	b.WriteByte('}')
	return b.String()
}

// PolicyKey returns the Redis key that holds the current version of a
// policy.
func PolicyKey(prefix, policy string) string { return internalKey(prefix, policy, "policy") }

// FleetKey returns the Redis key of the sorted set of live limiters of a
// policy (heartbeats).
func FleetKey(prefix, policy string) string { return internalKey(prefix, policy, "fleet") }

func internalKey(prefix, policy, kind string) string {
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
