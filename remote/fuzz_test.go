package remote

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/local"
)

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
	r := strings.NewReplacer("%7B", "{", "%7D", "}", "%3A", ":", "%25", "%")
	return r.Replace(s)
}

// FuzzBucketKey: for any prefix, policy and key that validate, the bucket
// key's hash tag is the whole braced (policy, key) pair, from which both
// come back exactly (so no two pairs share a Redis key, and none escapes
// its tag or its policy), and no internal key of any policy equals it.
func FuzzBucketKey(f *testing.F) {
	for _, seed := range [][3]string{
		{"", "api", "user-1"}, {"leasehold:", "p", "{"}, {"x:", "a:b", "}{"}, {"", "p", "a}:fleet"},
		{"", "p%", "%7B"}, {"", "p", "k}"}, {"", "{p}", "k"}, {"", "p", "\x00policy"},
	} {
		f.Add(seed[0], seed[1], seed[2])
	}
	f.Fuzz(func(t *testing.T, prefix, policy, key string) {
		if ValidateKey(prefix, policy, key) != nil {
			return
		}
		bk := BucketKey(prefix, policy, key)
		p := prefix
		if p == "" {
			p = DefaultPrefix
		}
		if !strings.HasPrefix(bk, p+"{") || !strings.HasSuffix(bk, "}") {
			t.Fatalf("BucketKey(%q, %q, %q) = %q: not prefix{...}", prefix, policy, key, bk)
		}
		tag := hashTag(bk)
		if tag != bk[len(p)+1:len(bk)-1] {
			t.Fatalf("BucketKey(%q, %q, %q) = %q: hash tag %q is not the whole braced part", prefix, policy, key, bk, tag)
		}
		ep, ek, ok := strings.Cut(tag, ":")
		if !ok || unescape(ep) != policy || unescape(ek) != key {
			t.Fatalf("BucketKey(%q, %q, %q) = %q: tag %q does not give back the policy and key", prefix, policy, key, bk, tag)
		}
		for _, internal := range []string{PolicyKey(prefix, policy), FleetKey(prefix, policy)} {
			if internal == bk {
				t.Fatalf("bucket key %q equals an internal key", bk)
			}
			if hashTag(internal) != ep {
				t.Fatalf("internal key %q hashes %q, want the policy's tag %q", internal, hashTag(internal), ep)
			}
		}
	})
}

// FuzzLimitValidate: a limit either fails with ErrInvalidLimit or is one
// every store can run: a request with it validates, a lease of Burst on a
// fresh MemoryStore bucket is granted in full, and a policy record of it
// (any valid version) survives the store's text form unchanged.
func FuzzLimitValidate(f *testing.F) {
	f.Add(int64(5), int64(time.Second), int64(3), uint64(1))
	f.Add(int64(1), int64(365*24*time.Hour), int64(2), uint64(7))
	f.Add(int64(1e9), int64(time.Second), int64(1e12), uint64(1)<<53)
	f.Add(int64(100_003), int64(24*time.Hour), int64(100_003), uint64(2))
	f.Add(int64(-1), int64(time.Second), int64(1), uint64(0))
	f.Add(int64(1), int64(1), int64(1<<62), uint64(1)<<60)
	f.Fuzz(func(t *testing.T, rate, period, burst int64, version uint64) {
		lim := local.Limit{Rate: rate, Period: time.Duration(period), Burst: burst}
		err := lim.Validate()
		if err != nil {
			if !errors.Is(err, local.ErrInvalidLimit) {
				t.Fatalf("Validate(%v) = %v, want ErrInvalidLimit", lim, err)
			}
			return
		}
		r := Request{Policy: "p", Key: "k", Limit: lim, Version: 1, N: burst}
		m, err := validate(OpLease, &r)
		if err != nil {
			t.Fatalf("valid limit %v: request refused: %v", lim, err)
		}
		st, res := apply(state{}, false, OpLease, &r, m, 1_700_000_000_000_000)
		if res.Granted != burst || st.level != 0 {
			t.Fatalf("valid limit %v: lease of Burst on a fresh bucket = %+v", lim, res)
		}
		rec := PolicyRecord{Version: version, Limit: lim}
		if err := validatePolicyRecord("", "p", rec); err != nil {
			if version == 0 || version > MaxVersion {
				return
			}
			t.Fatalf("record %+v refused: %v", rec, err)
		}
		text := fmt.Sprintf("%d %d %d %d", rec.Version, lim.Rate, int64(lim.Period/time.Microsecond), lim.Burst)
		back, err := decodePolicy("k", text)
		if err != nil || !reflect.DeepEqual(back, rec) {
			t.Fatalf("record %+v as %q decodes to %+v, %v", rec, text, back, err)
		}
	})
}
