package remote

import "github.com/leasehold/leasehold/internal/keys"

// Every Redis key this package writes is built by internal/keys, where the
// rules that keep keys apart are written down and fuzzed.

func bucketKey(r *Request) string { return keys.Bucket(r.Prefix, r.Policy, r.Tier, r.Key) }

// bucketKeys returns r's bucket key and its grants key, which the bucket
// script takes together, built as one string.
func bucketKeys(r *Request) (bucket, grants string) {
	return keys.BucketAndGrants(r.Prefix, r.Policy, r.Tier, r.Key)
}

func validateKey(prefix, policy, key string) error { return keys.Validate(prefix, policy, key) }
