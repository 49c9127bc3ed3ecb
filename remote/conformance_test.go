package remote

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/hooks"
	"github.com/leasehold/leasehold/internal/keys"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/local"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// backend is a Store under test with a way to move its clock. Fake backends
// (MemoryStore, miniredis) move virtual time; real Redis cannot, so time is
// advanced by waiting, and limits in the table are slow enough that the few
// milliseconds a call takes never add a token.
type backend struct {
	name    string
	store   Store
	real    bool
	advance func(time.Duration)
	exists  func(key string) bool
	ttl     func(key string) time.Duration
	client  redis.UniversalClient // nil for MemoryStore
}

func memoryBackend(t *testing.T) backend {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	s := NewMemory(clk)
	return backend{
		name: "memory", store: s, advance: clk.Advance,
		exists: func(key string) bool {
			s.mu.Lock()
			defer s.mu.Unlock()
			b, ok := s.mu.buckets[key]
			return ok && micros(clk.Now().UnixMicro()) < b.deadline
		},
		ttl: func(key string) time.Duration {
			s.mu.Lock()
			defer s.mu.Unlock()
			return time.Duration(s.mu.buckets[key].deadline.since(micros(clk.Now().UnixMicro()))) * time.Microsecond
		},
	}
}

func miniredisBackend(t *testing.T) backend {
	mr := miniredis.RunT(t)
	now := time.Unix(1_700_000_000, 0)
	mr.SetTime(now)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	// miniredis's TIME follows SetTime only and FastForward only ages TTLs,
	// so move both together.
	return backend{
		name: "miniredis", store: NewRedis(c), client: c,
		advance: func(d time.Duration) { now = now.Add(d); mr.SetTime(now); mr.FastForward(d) },
		exists:  func(key string) bool { return mr.Exists(key) },
		ttl:     func(key string) time.Duration { return mr.TTL(key) },
	}
}

func realBackend(name string, c redis.UniversalClient) backend {
	return backend{
		name: name, store: NewRedis(c), real: true, client: c,
		advance: func(d time.Duration) { time.Sleep(d) }, // real Redis TIME cannot be moved
		exists:  func(key string) bool { return c.Exists(context.Background(), key).Val() == 1 },
		ttl:     func(key string) time.Duration { return c.PTTL(context.Background(), key).Val() },
	}
}

// backends returns all four: MemoryStore, miniredis, real standalone Redis
// and the real cluster.
func backends(t *testing.T) []backend {
	t.Helper()
	out := []backend{memoryBackend(t), miniredisBackend(t)}
	if !redistest.Available() && os.Getenv(redistest.RequireEnv) != "1" {
		t.Log("redis-server not on PATH: real Redis and the real cluster are left out (make test installs them)")
		return out
	}
	out = append(out,
		realBackend("redis", redistest.Standalone(t).Client(t)),
		realBackend("cluster", redistest.SharedCluster(t).Client(t)))
	return out
}

type stepKind int

const (
	lease stepKind = iota
	ret
	debit
	wait
	checkTTL
)

type confStep struct {
	kind     stepKind
	n        int64
	min      int64
	need     int64
	maxDelay time.Duration
	version  uint64
	limit    *local.Limit // nil: the sequence's limit
	d        time.Duration
	// Shaped buckets: the step's limits replace the sequence's when
	// window or also is set; since takes the last lease's store time.
	window    bool
	also      []local.Limit
	hold      time.Duration
	sinceLast bool

	wantGranted int64
	wantLeft    int64 // -1: not checked
	wantRetry   time.Duration
	wantDelay   time.Duration
	wantStale   bool
	wantVersion uint64 // 0: the step's version
	wantBinding int
	// retrySlack widens the RetryAfter check below the wanted value:
	// sliding windows count in sub-windows aligned to store time, which a
	// real server's clock meets at any phase.
	retrySlack time.Duration
}

// Limits of the table: one token every 200 ms, so that the milliseconds real
// Redis spends between calls never add a token.
var (
	slow   = local.Limit{Rate: 5, Period: time.Second, Burst: 3}
	slow10 = local.Limit{Rate: 5, Period: time.Second, Burst: 10}
	ms     = time.Millisecond
)

var sequences = []struct {
	name  string
	limit local.Limit
	steps []confStep
}{
	{"lease within burst", slow, []confStep{
		{kind: lease, n: 2, wantGranted: 2, wantLeft: 1},
		{kind: lease, n: 1, wantGranted: 1, wantLeft: 0},
	}},
	{"partial grant", slow, []confStep{
		{kind: lease, n: 2, wantGranted: 2, wantLeft: 1},
		{kind: lease, n: 3, min: 1, wantGranted: 1, wantLeft: 0},
	}},
	{"empty bucket then refill", slow, []confStep{
		{kind: lease, n: 3, wantGranted: 3, wantLeft: 0},
		{kind: lease, n: 1, wantGranted: 0, wantLeft: 0, wantRetry: 200 * ms},
		{kind: wait, d: 300 * ms},
		{kind: lease, n: 1, wantGranted: 1, wantLeft: 0},
	}},
	{"min above remaining", slow, []confStep{
		{kind: lease, n: 2, wantGranted: 2, wantLeft: 1},
		{kind: lease, n: 3, min: 2, wantGranted: 0, wantLeft: 1, wantRetry: 200 * ms},
	}},
	{"return clamped at full bucket", slow, []confStep{
		{kind: lease, n: 2, wantGranted: 2, wantLeft: 1},
		{kind: ret, n: 5, wantLeft: 3},
		{kind: lease, n: 3, wantGranted: 3, wantLeft: 0},
	}},
	{"debit into debt", slow, []confStep{
		{kind: debit, n: 5, wantLeft: 0},
		{kind: lease, n: 1, wantGranted: 0, wantLeft: 0, wantRetry: 600 * ms},
		{kind: ret, n: 2, wantLeft: 0},
		{kind: lease, n: 1, wantGranted: 0, wantLeft: 0, wantRetry: 200 * ms},
	}},
	{"future-dated lease", slow, []confStep{
		{kind: lease, n: 3, wantGranted: 3, wantLeft: 0},
		{kind: lease, n: 2, maxDelay: time.Second, wantGranted: 2, wantLeft: 0, wantDelay: 400 * ms},
		// A refusal waits for the caller's need (min, 1 here), not for n
		// less the reservation horizon.
		{kind: lease, n: 2, maxDelay: 500 * ms, wantGranted: 0, wantLeft: 0, wantRetry: 600 * ms},
	}},
	// The bucket's tail (issue 10): a lease that cannot be filled nor
	// future-dated within maxDelay falls back to the tokens that are there
	// when they cover the caller's need, then to a reservation of the need,
	// and a refusal waits for the need alone.
	{"tail: tokens below a lease are granted", slow10, []confStep{
		{kind: lease, n: 8, wantGranted: 8, wantLeft: 2},
		{kind: lease, n: 5, min: 5, need: 1, maxDelay: 500 * ms, wantGranted: 2, wantLeft: 0},
		{kind: lease, n: 5, min: 5, need: 2, maxDelay: 500 * ms, wantGranted: 2, wantLeft: 0, wantDelay: 400 * ms},
		{kind: lease, n: 5, min: 5, need: 1, maxDelay: 100 * ms, wantGranted: 0, wantLeft: 0, wantRetry: 600 * ms},
	}},
	{"version up keeps tokens used", slow, []confStep{
		{kind: lease, n: 2, version: 1, wantGranted: 2, wantLeft: 1},
		{kind: lease, n: 10, version: 2, limit: &slow10, wantGranted: 8, wantLeft: 0},
	}},
	{"version up clamps used to the new burst", slow10, []confStep{
		{kind: lease, n: 8, version: 1, wantGranted: 8, wantLeft: 2},
		{kind: lease, n: 1, version: 2, limit: &slow, wantGranted: 0, wantLeft: 0, wantRetry: 200 * ms},
	}},
	{"version down is refused", slow, []confStep{
		{kind: lease, n: 1, version: 2, wantGranted: 1, wantLeft: 2},
		{kind: lease, n: 1, version: 1, limit: &slow10, wantGranted: 0, wantLeft: 2, wantStale: true, wantVersion: 2},
		{kind: ret, n: 1, version: 1, limit: &slow10, wantLeft: 3, wantStale: true, wantVersion: 2},
		{kind: lease, n: 3, version: 2, wantGranted: 3, wantLeft: 0},
	}},
	{"ttl is time to full plus margin", slow, []confStep{
		{kind: lease, n: 2, wantGranted: 2, wantLeft: 1},
		{kind: checkTTL, d: 400*ms + TTLMargin},
	}},
	{"a billion per second, burst 1e12", local.Limit{Rate: 1e9, Period: time.Second, Burst: 1e12}, []confStep{
		{kind: lease, n: 1e12, wantGranted: 1e12, wantLeft: -1},
		{kind: lease, n: 1e12, min: 1e12, wantGranted: 0, wantLeft: -1, wantRetry: 1000 * time.Second},
	}},
	{"one per year", local.Limit{Rate: 1, Period: 365 * 24 * time.Hour, Burst: 2}, []confStep{
		{kind: lease, n: 2, wantGranted: 2, wantLeft: 0},
		{kind: lease, n: 1, wantGranted: 0, wantLeft: 0, wantRetry: 365 * 24 * time.Hour},
		{kind: ret, n: 1, wantLeft: 1},
		{kind: lease, n: 1, wantGranted: 1, wantLeft: 0},
	}},

	// Shaped buckets (issue 13). win4 is 4 per second in sub-windows of
	// 10 ms; a sub-window's tokens leave the window 1 s after its end, so
	// a wait is 1 s plus up to one sub-window.
	{"window: at most rate in a period", win4, []confStep{
		{kind: lease, n: 3, window: true, wantGranted: 3, wantLeft: 1},
		{kind: lease, n: 2, window: true, wantGranted: 1, wantLeft: 0},
		{kind: lease, n: 1, window: true, wantRetry: 1010 * ms, retrySlack: 10 * ms},
		{kind: wait, d: 1100 * ms},
		{kind: lease, n: 4, window: true, wantGranted: 4, wantLeft: 0},
	}},
	{"window: leased tokens count until they may be spent", win4, []confStep{
		{kind: lease, n: 4, window: true, hold: 100 * ms, wantGranted: 4, wantLeft: 0},
		{kind: wait, d: 1050 * ms},
		{kind: lease, n: 1, window: true, hold: 100 * ms, wantRetry: 60 * ms, retrySlack: 10 * ms},
		{kind: wait, d: 100 * ms},
		{kind: lease, n: 4, window: true, hold: 100 * ms, wantGranted: 4, wantLeft: 0},
	}},
	{"window: a return leaves the sub-window of since plus hold", win4, []confStep{
		{kind: lease, n: 4, window: true, hold: 100 * ms, wantGranted: 4, wantLeft: 0},
		{kind: ret, n: 2, window: true, hold: 100 * ms, sinceLast: true, wantLeft: 2},
		{kind: ret, n: 2, window: true, hold: 100 * ms, wantLeft: 2}, // no since: nothing back
		{kind: lease, n: 3, window: true, hold: 100 * ms, wantGranted: 2, wantLeft: 0},
	}},
	{"window: a debit counts now", win4, []confStep{
		{kind: debit, n: 6, window: true, wantLeft: 0},
		{kind: lease, n: 1, window: true, wantRetry: 1010 * ms, retrySlack: 10 * ms},
	}},
	{"window: rate up keeps what the window holds", win4, []confStep{
		{kind: lease, n: 4, version: 1, window: true, wantGranted: 4, wantLeft: 0},
		{kind: lease, n: 6, version: 2, window: true, limit: &win6, wantGranted: 2, wantLeft: 0},
	}},
	{"two limits: the tightest decides", slow10, []confStep{
		{kind: lease, n: 2, also: []local.Limit{perSec3}, wantGranted: 2, wantLeft: 1, wantBinding: 1},
		{kind: lease, n: 3, also: []local.Limit{perSec3}, wantGranted: 1, wantLeft: 0, wantBinding: 1},
		{kind: lease, n: 1, also: []local.Limit{perSec3}, wantRetry: 333334 * time.Microsecond, wantBinding: 1},
		{kind: ret, n: 2, also: []local.Limit{perSec3}, wantLeft: 2},
		{kind: lease, n: 2, also: []local.Limit{perSec3}, wantGranted: 2, wantLeft: 0, wantBinding: 1},
	}},
	{"two windows: a second and ten seconds", win4, []confStep{
		{kind: lease, n: 4, window: true, also: []local.Limit{win6Per10s}, wantGranted: 4, wantLeft: 0},
		{kind: wait, d: 1100 * ms},
		{kind: lease, n: 4, window: true, also: []local.Limit{win6Per10s}, wantGranted: 2, wantLeft: 0, wantBinding: 1},
		{kind: lease, n: 1, window: true, also: []local.Limit{win6Per10s}, wantRetry: 9000 * ms, retrySlack: 200 * ms, wantBinding: 1},
	}},
	{"bucket to window keeps tokens used", slow, []confStep{
		{kind: lease, n: 2, version: 1, wantGranted: 2, wantLeft: 1},
		{kind: lease, n: 4, version: 2, window: true, limit: &win4, wantGranted: 2, wantLeft: 0},
	}},
	{"window back to bucket keeps tokens used", win4, []confStep{
		{kind: lease, n: 3, version: 1, window: true, wantGranted: 3, wantLeft: 1},
		{kind: lease, n: 10, version: 2, limit: &slow10, wantGranted: 7, wantLeft: 0},
	}},
}

var (
	win4       = local.Limit{Rate: 4, Period: time.Second, Burst: 4}
	win6       = local.Limit{Rate: 6, Period: time.Second, Burst: 6}
	win6Per10s = local.Limit{Rate: 6, Period: 10 * time.Second, Burst: 6}
	perSec3    = local.Limit{Rate: 3, Period: time.Second, Burst: 3}
)

func TestConformance(t *testing.T) {
	for _, be := range backends(t) {
		t.Run(be.name, func(t *testing.T) {
			t.Parallel()
			for _, seq := range sequences {
				t.Run(seq.name, func(t *testing.T) {
					if be.real {
						t.Parallel() // real backends wait in real time
					}
					runSequence(t, be, t.Name(), seq.limit, seq.steps)
				})
			}
		})
	}
}

func runSequence(t *testing.T, be backend, key string, lim local.Limit, steps []confStep) {
	t.Helper()
	ctx := context.Background()
	var lastNow time.Time
	for i, s := range steps {
		req := Request{Policy: "conformance", Key: key, Limit: lim, Version: s.version, N: s.n, Min: s.min, Need: s.need,
			MaxDelay: s.maxDelay, Window: s.window, Also: s.also, Hold: s.hold}
		if s.limit != nil {
			req.Limit = *s.limit
		}
		if s.sinceLast {
			req.Since = lastNow
		}
		var (
			res Result
			err error
		)
		switch s.kind {
		case wait:
			be.advance(s.d)
			continue
		case checkTTL:
			k := keys.Bucket("", "conformance", "", key)
			got := be.ttl(k)
			lo := s.d - 100*ms
			if got > s.d || got < lo {
				t.Errorf("step %d: TTL(%s) = %v, want in [%v, %v]", i, k, got, lo, s.d)
			}
			if !be.real {
				be.advance(s.d)
				if be.exists(k) {
					t.Errorf("step %d: bucket still exists after its TTL", i)
				}
			}
			continue
		case lease:
			res, err = be.store.Lease(ctx, req)
		case ret:
			res, err = be.store.Return(ctx, req)
		case debit:
			res, err = be.store.Debit(ctx, req)
		}
		if err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if s.kind == lease {
			lastNow = res.Now
		}
		if res.Binding != s.wantBinding {
			t.Errorf("step %d: Binding = %d, want %d", i, res.Binding, s.wantBinding)
		}
		wantVersion := s.wantVersion
		if wantVersion == 0 {
			wantVersion = s.version
		}
		if res.Granted != s.wantGranted || (s.wantLeft >= 0 && res.Remaining != s.wantLeft) ||
			res.Stale != s.wantStale || res.Version != wantVersion {
			t.Errorf("step %d: %+v\n got granted %d left %d stale %v version %d\nwant granted %d left %d stale %v version %d",
				i, req, res.Granted, res.Remaining, res.Stale, res.Version, s.wantGranted, s.wantLeft, s.wantStale, wantVersion)
		}
		// Fake clocks are exact; real Redis has spent a little time since
		// the state was written, which only shortens waits.
		slack := time.Duration(0)
		if be.real {
			slack = 100 * ms
		}
		if res.RetryAfter > s.wantRetry || res.RetryAfter < s.wantRetry-slack-s.retrySlack {
			t.Errorf("step %d: RetryAfter = %v, want %v (slack %v)", i, res.RetryAfter, s.wantRetry, slack)
		}
		if res.Delay > s.wantDelay || res.Delay < s.wantDelay-slack {
			t.Errorf("step %d: Delay = %v, want %v (slack %v)", i, res.Delay, s.wantDelay, slack)
		}
		if res.Now.IsZero() || res.Now.Year() < 2020 {
			t.Errorf("step %d: store time %v implausible", i, res.Now)
		}
	}
}

func TestBadInputSameEverywhere(t *testing.T) {
	lim := local.PerSecond(10)
	long := string(make([]byte, MaxKeyLen+1))
	cases := []struct {
		name string
		op   Op
		req  Request
		want error
	}{
		{"empty key", OpLease, Request{Policy: "p", Key: "", Limit: lim, N: 1}, ErrInvalidKey},
		{"key over 1 KiB", OpLease, Request{Policy: "p", Key: long, Limit: lim, N: 1}, ErrInvalidKey},
		{"brace in prefix", OpLease, Request{Prefix: "a{b", Policy: "p", Key: "k", Limit: lim, N: 1}, ErrInvalidKey},
		{"empty policy", OpLease, Request{Policy: "", Key: "k", Limit: lim, N: 1}, ErrInvalidPolicy},
		{"version beyond 2^53", OpLease, Request{Policy: "p", Key: "k", Limit: lim, N: 1, Version: MaxVersion + 1}, ErrInvalidPolicy},
		{"n zero", OpLease, Request{Policy: "p", Key: "k", Limit: lim, N: 0}, local.ErrInvalidN},
		{"n negative return", OpReturn, Request{Policy: "p", Key: "k", Limit: lim, N: -3}, local.ErrInvalidN},
		{"n negative debit", OpDebit, Request{Policy: "p", Key: "k", Limit: lim, N: -3}, local.ErrInvalidN},
		{"min above n", OpLease, Request{Policy: "p", Key: "k", Limit: lim, N: 2, Min: 3}, local.ErrInvalidN},
		{"n over burst", OpLease, Request{Policy: "p", Key: "k", Limit: lim, N: 11}, local.ErrExceedsBurst},
		{"rate zero", OpLease, Request{Policy: "p", Key: "k", Limit: local.Limit{Period: time.Second, Burst: 1}, N: 1}, local.ErrInvalidLimit},
		{"period zero", OpLease, Request{Policy: "p", Key: "k", Limit: local.Limit{Rate: 1, Burst: 1}, N: 1}, local.ErrInvalidLimit},
		{"burst zero", OpLease, Request{Policy: "p", Key: "k", Limit: local.Limit{Rate: 1, Period: time.Second}, N: 1}, local.ErrInvalidLimit},
		{"overflowing limit", OpLease, Request{Policy: "p", Key: "k", Limit: local.Limit{Rate: 1, Period: 200 * 365 * 24 * time.Hour, Burst: 1e12}, N: 1}, local.ErrInvalidLimit},
		{"negative max delay", OpLease, Request{Policy: "p", Key: "k", Limit: lim, N: 1, MaxDelay: -1}, local.ErrInvalidLimit},
		{"window burst not its rate", OpLease, Request{Policy: "p", Key: "k", Limit: local.Limit{Rate: 10, Period: time.Second, Burst: 20}, Window: true, N: 1}, local.ErrInvalidLimit},
		{"hold beyond a tenth of the window", OpLease, Request{Policy: "p", Key: "k", Limit: lim, Window: true, Hold: 101 * time.Millisecond, N: 1}, local.ErrInvalidLimit},
		{"invalid also", OpLease, Request{Policy: "p", Key: "k", Limit: lim, Also: []local.Limit{{Rate: 1}}, N: 1}, local.ErrInvalidLimit},
		{"n over the tightest limit", OpLease, Request{Policy: "p", Key: "k", Limit: lim, Also: []local.Limit{local.PerMinute(5)}, N: 6}, local.ErrExceedsBurst},
		{"too many limits", OpLease, Request{Policy: "p", Key: "k", Limit: lim, Also: make9(lim), N: 1}, ErrInvalidPolicy},
		{"tier with a colon", OpLease, Request{Policy: "p", Tier: "a:b", Key: "k", Limit: lim, N: 1}, ErrInvalidPolicy},
	}
	for _, be := range backends(t) {
		for _, c := range cases {
			var err error
			switch c.op {
			case OpLease:
				_, err = be.store.Lease(context.Background(), c.req)
			case OpReturn:
				_, err = be.store.Return(context.Background(), c.req)
			case OpDebit:
				_, err = be.store.Debit(context.Background(), c.req)
			}
			if !errors.Is(err, c.want) {
				t.Errorf("%s/%s: error %v, want %v", be.name, c.name, err, c.want)
			}
			replies := be.store.Batch(context.Background(), c.op, []Request{c.req})
			if !errors.Is(replies[0].Err, c.want) {
				t.Errorf("%s/%s: Batch error %v, want %v", be.name, c.name, replies[0].Err, c.want)
			}
		}
	}
}

func TestForeignDataInBucketKey(t *testing.T) {
	for _, be := range backends(t) {
		if be.client == nil {
			continue
		}
		t.Run(be.name, func(t *testing.T) {
			ctx := context.Background()
			for _, tc := range []struct {
				name  string
				write func(key string) error
			}{
				{"hash (WRONGTYPE)", func(k string) error { return be.client.HSet(ctx, k, "f", "v").Err() }},
				{"foreign string", func(k string) error { return be.client.Set(ctx, k, "hello", 0).Err() }},
				{"out-of-range state", func(k string) error { return be.client.Set(ctx, k, "1 0 1 1 5 0 7", 0).Err() }},
				{"shaped, counters missing", func(k string) error { return be.client.Set(ctx, k, "S 1 1;w 1 2 4 1000000 0 0", 0).Err() }},
				{"shaped, parts miscounted", func(k string) error { return be.client.Set(ctx, k, "S 1 2;g 1 0 1 5 5 5", 0).Err() }},
				{"shaped, unknown part", func(k string) error { return be.client.Set(ctx, k, "S 1 1;x 1 2 3", 0).Err() }},
			} {
				// Plain and shaped requests read the same keys: each script
				// must refuse what it cannot trust.
				for _, shaped := range []bool{false, true} {
					key := fmt.Sprintf("%s%s-%v", t.Name(), tc.name, shaped)
					require.NoError(t, tc.write(keys.Bucket("", "p", "", key)))
					req := Request{Policy: "p", Key: key, Limit: win4, N: 1, Window: shaped}
					_, err := be.store.Lease(ctx, req)
					if !errors.Is(err, ErrCorruptState) {
						t.Errorf("%s (shaped %v): Lease error = %v, want ErrCorruptState", tc.name, shaped, err)
					} else if !containsKey(err.Error(), key) {
						t.Errorf("%s: error %q does not name the key", tc.name, err)
					}
				}
			}
		})
	}
}

func containsKey(msg, key string) bool {
	return len(key) > 0 && len(msg) >= len(key) && (func() bool {
		for i := 0; i+len(key) <= len(msg); i++ {
			if msg[i:i+len(key)] == key {
				return true
			}
		}
		return false
	})()
}

func TestScriptFlushBetweenCalls(t *testing.T) {
	for _, be := range backends(t) {
		if be.client == nil {
			continue
		}
		t.Run(be.name, func(t *testing.T) {
			ctx := context.Background()
			req := Request{Policy: "p", Key: t.Name(), Limit: slow10, N: 1}
			for i := 0; i < 3; i++ {
				flush(t, be.client)
				res, err := be.store.Lease(ctx, req)
				require.NoError(t, err, "Lease after SCRIPT FLUSH")
				if res.Granted != 1 {
					t.Fatalf("Lease #%d after flush granted %d, want 1", i, res.Granted)
				}
				flush(t, be.client)
				reqs := []Request{req, {Policy: "p", Key: t.Name() + "-other{x}", Limit: slow10, N: 2},
					{Policy: "p", Key: t.Name() + "-window", Limit: win4, Window: true, N: 1}}
				for j, r := range be.store.Batch(ctx, OpLease, reqs) {
					require.NoError(t, r.Err, "Batch after SCRIPT FLUSH, reply %d", j)
					if r.Granted != reqs[j].N {
						t.Fatalf("Batch reply %d granted %d, want %d", j, r.Granted, reqs[j].N)
					}
				}
			}
		})
	}
}

func flush(t *testing.T, c redis.UniversalClient) { redistest.FlushScripts(t, c) }

// TestOutOfMemoryIsMarked: a real Redis out of memory under noeviction
// refuses a lease with OOM, which the store reports as unavailable and
// unreachable, and marked hooks.ErrFull for the breaker's probation.
// Other failures are not marked.
func TestOutOfMemoryIsMarked(t *testing.T) {
	srv := redistest.NewServer(t, "--maxmemory-policy", "noeviction")
	c := srv.Client(t)
	ctx := context.Background()
	s := NewRedis(c)
	req := Request{Policy: "p", Key: "oom", Limit: slow10, N: 1}
	require.NoError(t, c.ConfigSet(ctx, "maxmemory", "1").Err())
	_, err := s.Lease(ctx, req)
	for _, want := range []error{ErrUnavailable, ErrUnreachable, hooks.ErrFull} {
		require.ErrorIs(t, err, want)
	}
	require.ErrorContains(t, err, "OOM")
	require.NoError(t, c.ConfigSet(ctx, "maxmemory", "0").Err())
	_, err = s.Lease(ctx, req)
	require.NoError(t, err)
	require.NoError(t, srv.Kill())
	_, err = s.Lease(ctx, req)
	require.ErrorIs(t, err, ErrUnreachable)
	require.NotErrorIs(t, err, hooks.ErrFull)
}

func TestCheckClient(t *testing.T) {
	bad := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	good := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true})
	defer bad.Close()
	defer good.Close()
	if err := checkClient(bad); err == nil {
		t.Error("checkClient on a client without ContextTimeoutEnabled = nil")
	}
	if err := checkClient(good); err != nil {
		t.Errorf("checkClient on a well-configured client = %v", err)
	}
	// The eviction half skips a server it cannot ask.
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := NewRedis(good).Check(ctx); err != nil {
		t.Errorf("Check on a well-configured client without a server = %v", err)
	}
	if err := NewRedis(bad).Check(ctx); err == nil || !strings.Contains(err.Error(), "ContextTimeoutEnabled") {
		t.Errorf("Check on a client without ContextTimeoutEnabled = %v", err)
	}
}

func make9(l local.Limit) []local.Limit {
	out := make([]local.Limit, maxLimits)
	for i := range out {
		out[i] = l
	}
	return out
}
