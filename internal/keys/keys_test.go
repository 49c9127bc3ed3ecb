package keys

import (
	"context"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
)

func TestMain(m *testing.M) { redistest.Main(m) }

func TestEscaping(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, got, want string
	}{
		{"bucket", Bucket("", "api", "", "user:1"), "leasehold:{api:user:1}"},
		{"policy with ':'", Bucket("x:", "a:b", "", "c"), "x:{a%3Ab:c}"},
		{"key with ':'", Bucket("x:", "a", "", "b:c"), "x:{a:b:c}"},
		{"braces", Bucket("", "p", "", "}{evil"), "leasehold:{p:%7D%7Bevil}"},
		{"percent", Bucket("", "p", "", "100%"), "leasehold:{p:100%25}"},
		{"tier bucket", Bucket("", "api", "paid", "u:1"), "leasehold:{api%~paid:u:1}"},
		{"pool", Pool("", "api", "paid", "u:1"), "leasehold:{api%~paid:u:1}:pool"},
		{"grants", Grants("", "api", "", "u:1"), "leasehold:{api:u:1}:grants"},
		{"slots", Slots("", "api", "paid", "u:1"), "leasehold:{api%~paid:u:1}:slots"},
		{"policy", Policy("", "a:b"), "leasehold:{a%3Ab}:policy"},
		{"fleet", Fleet("p:", "a"), "p:{a}:fleet"},
		{"world", World("", "a"), "leasehold:{a}:world"},
		{"region", Region("", "a"), "leasehold:{a}:region"},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, tt.got, tt.want)
		}
	}
}

// hashTag returns what Redis Cluster hashes for key: the part between the
// first '{' and the first '}' after it, if non-empty; else the whole key.
func hashTag(key string) string {
	open := strings.IndexByte(key, '{')
	if open < 0 {
		return key
	}
	end := strings.IndexByte(key[open+1:], '}')
	if end <= 0 {
		return key
	}
	return key[open+1 : open+1+end]
}

// unescape reverses escape.
func unescape(s string) string {
	return strings.NewReplacer("%7B", "{", "%7D", "}", "%3A", ":", "%25", "%").Replace(s)
}

// kinds builds every kind of key for one (prefix, policy, tier, key),
// named, with what the kind's tag must give back.
func kinds(prefix, policy, tier, key string) []struct{ kind, key, suffix string } {
	return []struct{ kind, key, suffix string }{
		{"bucket", Bucket(prefix, policy, "", key), ""},
		{"shaped bucket", Bucket(prefix, policy, "", key), ""}, // one key, the value tells
		{"tier bucket", Bucket(prefix, policy, tier, key), ""},
		{"pool", Pool(prefix, policy, tier, key), ":" + kindPool},
		{"grants", Grants(prefix, policy, tier, key), ":" + kindGrants},
		{"slots", Slots(prefix, policy, tier, key), ":" + kindSlots},
		{"policy", Policy(prefix, policy), ":" + kindPolicy},
		{"fleet", Fleet(prefix, policy), ":" + kindFleet},
		{"world", World(prefix, policy), ":" + kindWorld},
		{"region", Region(prefix, policy), ":" + kindRegion},
	}
}

// FuzzKeys holds every kind of key to the rules of the package doc: for
// any names that validate, each key is prefix{tag}suffix with the tag its
// only braced part; a bucket's (and its pool's) tag gives back exactly the
// policy, tier and key, so no two triples share one; the policy's internal
// keys hash to the policy alone; bucket keys end in '}', every other kind
// in '}:' and its own name; no two kinds of key are equal; and
// BucketAndGrants is Bucket and Grants.
func FuzzKeys(f *testing.F) {
	for _, seed := range [][4]string{
		{"", "api", "", "user-1"}, {"leasehold:", "p", "paid", "{"}, {"x:", "a:b", "t", "}{"},
		{"", "p", "", "a}:fleet"}, {"", "p%", "7B", "%7B"}, {"", "p", "", "k}"}, {"", "{p}", "", "k"},
		{"", "p", "", "\x00policy"}, {"", "p%~t", "", "k"}, {"", "p", "t", "k}:pool"},
	} {
		f.Add(seed[0], seed[1], seed[2], seed[3])
	}
	f.Fuzz(func(t *testing.T, prefix, policy, tier, key string) {
		if Validate(prefix, policy, key) != nil || ValidateTier(tier) != nil {
			return
		}
		p := prefix
		if p == "" {
			p = DefaultPrefix
		}
		if b, g := BucketAndGrants(prefix, policy, tier, key); b != Bucket(prefix, policy, tier, key) || g != Grants(prefix, policy, tier, key) {
			t.Fatalf("BucketAndGrants = %q, %q; want %q, %q", b, g, Bucket(prefix, policy, tier, key), Grants(prefix, policy, tier, key))
		}
		seen := map[string]string{}
		for _, k := range kinds(prefix, policy, tier, key) {
			if prev, dup := seen[k.key]; dup && !(prev == "bucket" && k.kind == "shaped bucket") &&
				!(tier == "" && k.kind == "tier bucket") {
				t.Fatalf("%s key %q equals the %s key", k.kind, k.key, prev)
			}
			seen[k.key] = k.kind
			if !strings.HasPrefix(k.key, p+"{") || !strings.HasSuffix(k.key, "}"+k.suffix) {
				t.Fatalf("%s key %q: not %s{...}%s", k.kind, k.key, p, k.suffix)
			}
			tag := hashTag(k.key)
			if tag != k.key[len(p)+1:len(k.key)-len(k.suffix)-1] {
				t.Fatalf("%s key %q: hash tag %q is not the whole braced part", k.kind, k.key, tag)
			}
			switch k.kind {
			case "policy", "fleet", "world", "region":
				if strings.ContainsRune(tag, ':') || unescape(tag) != policy {
					t.Fatalf("%s key %q: tag %q is not the policy %q alone", k.kind, k.key, tag, policy)
				}
			default:
				pt, ek, ok := strings.Cut(tag, ":")
				ep, et, tiered := strings.Cut(pt, "%~")
				wantTier := tier
				if k.kind == "bucket" || k.kind == "shaped bucket" {
					wantTier = ""
				}
				if !ok || unescape(ep) != policy || unescape(ek) != key || tiered != (wantTier != "") || unescape(et) != wantTier {
					t.Fatalf("%s key %q: tag %q does not give back policy %q, tier %q, key %q", k.kind, k.key, tag, policy, wantTier, key)
				}
			}
		}
	})
}

// TestNoCollisionsSameSlot checks, over tricky inputs, that distinct
// (policy, tier, key) triples never share a Redis key, never equal an
// internal key, and that every key lands in the slot of its own tag.
func TestNoCollisionsSameSlot(t *testing.T) {
	t.Parallel()
	parts := []string{"a", "a:b", "b", ":", "{", "}", "{}", "}{", "%", "%7B", "%3A", "a:", ":b", "x{y}z"}
	tiers := []string{"", "a", "b", "25", "7B", "a.b", "-"}
	seen := map[string]string{}
	for _, p := range append(parts, "a%~b", "a%", "~") {
		for _, k := range parts {
			for _, tier := range tiers {
				for _, kd := range kinds("", p, tier, k) {
					if kd.kind == "shaped bucket" || kd.kind == "bucket" {
						continue // the tier bucket of tier "" is the bucket; shaped share it
					}
					if kd.kind != "bucket" && kd.kind != "tier bucket" && kd.kind != "pool" && (k != "a" || tier != "") {
						continue // the policy's internal keys: once per policy
					}
					id := kd.kind + " " + p + " tier " + tier + " key " + k
					if prev, dup := seen[kd.key]; dup {
						t.Fatalf("%s: %q collides with %s", id, kd.key, prev)
					}
					seen[kd.key] = id
					if got, want := redisSlot(kd.key), redisSlot(hashTag(kd.key)); got != want {
						t.Fatalf("slot of %q = %d, want %d", kd.key, got, want)
					}
				}
			}
		}
	}
}

// redisSlot is Redis Cluster's key slot: CRC16/XMODEM of the hash tag (or
// the whole key) mod 16384, as in the cluster spec.
func redisSlot(key string) int {
	key = hashTag(key)
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

// TestSlotOnRealCluster asks the real cluster where keys of every kind
// built from hostile input land, and checks it against the escaped tag.
func TestSlotOnRealCluster(t *testing.T) {
	c := redistest.SharedCluster(t).Client(t)
	ctx := context.Background()
	for _, k := range []string{"user:{42}:}{x:", "}", "{", "a{b}c", "plain"} {
		for _, kd := range kinds("", "p:q", "gold", k) {
			got, err := c.ClusterKeySlot(ctx, kd.key).Result()
			if err != nil {
				t.Fatal(err)
			}
			if want := redisSlot(kd.key); int(got) != want {
				t.Errorf("CLUSTER KEYSLOT %q = %d, want %d", kd.key, got, want)
			}
			tag := hashTag(kd.key)
			if tagSlot, _ := c.ClusterKeySlot(ctx, tag).Result(); tagSlot != got {
				t.Errorf("slot of %s key %q = %d, slot of its tag %q = %d", kd.kind, kd.key, got, tag, tagSlot)
			}
		}
	}
}
