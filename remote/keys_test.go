package remote

import (
	"context"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/internal/redistest"
)

func TestBucketKeyEscaping(t *testing.T) {
	t.Parallel()
	tests := []struct {
		prefix, policy, key, want string
	}{
		{"", "api", "user:1", "leasehold:{api:user:1}"},
		{"x:", "a:b", "c", "x:{a%3Ab:c}"},
		{"x:", "a", "b:c", "x:{a:b:c}"},
		{"", "p", "}{evil", "leasehold:{p:%7D%7Bevil}"},
		{"", "p", "100%", "leasehold:{p:100%25}"},
	}
	if got, want := TierBucketKey("", "api", "paid", "u:1"), "leasehold:{api%~paid:u:1}"; got != want {
		t.Errorf("TierBucketKey = %q, want %q", got, want)
	}
	for _, tt := range tests {
		if got := BucketKey(tt.prefix, tt.policy, tt.key); got != tt.want {
			t.Errorf("BucketKey(%q, %q, %q) = %q, want %q", tt.prefix, tt.policy, tt.key, got, tt.want)
		}
	}
}

// TestBucketKeyNoCollisionsSameSlot checks, over tricky inputs, that
// distinct (policy, key) pairs never share a Redis key, never equal an
// internal key, and that a bucket lands in the slot of its own braced part.
func TestBucketKeyNoCollisionsSameSlot(t *testing.T) {
	t.Parallel()
	parts := []string{"a", "a:b", "b", ":", "{", "}", "{}", "}{", "%", "%7B", "%3A", "a:", ":b", "x{y}z"}
	seen := map[string][2]string{}
	for _, p := range parts {
		for _, internal := range []string{PolicyKey("", p), FleetKey("", p)} {
			seen[internal] = [2]string{"internal", p}
		}
	}
	tiers := []string{"", "a", "b", "25", "7B", "a.b", "-"}
	for _, p := range append(parts, "a%~b", "a%", "~") {
		for _, k := range parts {
			for _, tier := range tiers {
				key := TierBucketKey("", p, tier, k)
				if prev, dup := seen[key]; dup {
					t.Fatalf("TierBucketKey(%q, %q, %q) = %q collides with %v", p, tier, k, key, prev)
				}
				seen[key] = [2]string{p + " tier " + tier, k}
				open, close := strings.IndexByte(key, '{'), strings.IndexByte(key, '}')
				if open < 0 || close != len(key)-1 {
					t.Fatalf("BucketKey(%q, %q) = %q: hash tag is not the whole braced tail", p, k, key)
				}
				if got, want := redisSlot(key), redisSlot(key[open+1:close]); got != want {
					t.Fatalf("slot of %q = %d, want %d", key, got, want)
				}
			}
		}
	}
}

// redisSlot is Redis Cluster's key slot: CRC16/XMODEM of the hash tag (or
// the whole key) mod 16384, as in the cluster spec.
func redisSlot(key string) int {
	if open := strings.IndexByte(key, '{'); open >= 0 {
		if close := strings.IndexByte(key[open+1:], '}'); close > 0 {
			key = key[open+1 : open+1+close]
		}
	}
	var crc uint16
	for i := 0; i < len(key); i++ {
		crc ^= uint16(key[i]) << 8
		for b := 0; b < 8; b++ {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) % 16384
}

// TestBucketKeySlotOnRealCluster asks the real cluster where keys built
// from hostile input land, and checks it against the escaped tag.
func TestBucketKeySlotOnRealCluster(t *testing.T) {
	c := redistest.SharedCluster(t).Client(t)
	ctx := context.Background()
	for _, k := range []string{"user:{42}:}{x:", "}", "{", "a{b}c", "plain"} {
		key := BucketKey("", "p:q", k)
		got, err := c.ClusterKeySlot(ctx, key).Result()
		if err != nil {
			t.Fatal(err)
		}
		if want := redisSlot(key); int(got) != want {
			t.Errorf("CLUSTER KEYSLOT %q = %d, want %d", key, got, want)
		}
		tag := key[strings.IndexByte(key, '{')+1 : len(key)-1]
		if tagSlot, _ := c.ClusterKeySlot(ctx, tag).Result(); tagSlot != got {
			t.Errorf("slot of %q = %d, slot of its tag %q = %d", key, got, tag, tagSlot)
		}
	}
}
