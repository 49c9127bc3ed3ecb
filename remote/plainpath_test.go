package remote

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/local"
)

// TestPlainPathTwinsAgree: a lease or a return on a bucket without
// grants, absent or kept under the caller's limit, takes the script's
// plain path (locals in place of the general path's table and closures).
// From random states written into the key (refills of any length, a clock
// stepped back, levels below zero with debits owed, spill at its cap,
// future-dated and refused leases, returns) its answer and the state it
// writes are the Go twin's; so are the general path's on the states it
// leaves there (an older state format, another limit or version, an
// empty grants record).
func TestPlainPathTwinsAgree(t *testing.T) {
	t.Run("miniredis", func(t *testing.T) {
		c, _, _ := miniredisTwin(t)
		plainPathTwins(t, c, 800)
	})
	t.Run("redis", func(t *testing.T) {
		plainPathTwins(t, redistest.Standalone(t).Client(t), 800)
	})
}

func plainPathTwins(t *testing.T, c redis.UniversalClient, cases int) {
	t.Helper()
	ctx := context.Background()
	s := NewRedis(c)
	run := fmt.Sprint(time.Now().UnixNano())
	r := rand.New(rand.NewPCG(23, 23))
	periods := []time.Duration{time.Second, 100 * time.Millisecond, time.Minute, 1500 * time.Millisecond, time.Hour}
	general := 0
	for i := range cases {
		lim := local.Limit{Rate: 1 + r.Int64N(3000), Period: periods[r.IntN(len(periods))], Burst: 1 + r.Int64N(400)}
		req := Request{Policy: "ppath", Key: fmt.Sprintf("pp-%s-%d", run, i), Limit: lim, Version: 1 + uint64(r.IntN(3)), N: 1 + r.Int64N(lim.Burst)}
		m, err := validate(OpLease, &Request{Policy: "ppath", Key: "k", Limit: lim, N: 1})
		if err != nil {
			t.Fatal(err)
		}
		req.Need = 1 + r.Int64N(req.N)
		req.Min = req.Need + r.Int64N(req.N-req.Need+1)
		if r.IntN(2) == 0 {
			req.MaxDelay = time.Duration(r.Int64N(int64(2*time.Second))) / time.Microsecond * time.Microsecond
		}
		op := OpLease
		if r.IntN(3) == 0 {
			op = OpReturn
			req.N = 1 + r.Int64N(2*lim.Burst)
		}
		tm, err := c.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		now := tm.UnixMicro()
		bucket, grants := bucketKeys(&req)

		kind := r.IntN(10)
		st := state{level: r.Int64N(3*m.Burst) - 2*m.Burst, carry: r.Int64N(m.Per), version: req.Version,
			burst: m.Burst, rate: m.Rate, per: m.Per, born: micros(now - r.Int64N(1e9)), spill: r.Int64N(5 * m.Burst)}
		// From a moment ago to many times the bucket's time to full.
		st.last = micros(now - r.Int64N(max(m.Per*(m.Burst/m.Rate+2)*3, 1)))
		st.owed = r.Int64N(max(-st.level, 0) + m.Burst)
		switch kind {
		case 1:
			st.last = micros(now + r.Int64N(5e6)) // the store clock stepped back
		case 2:
			st.spill = maxDebt - r.Int64N(3)
			st.last = 0 // decades of refill
		case 3:
			st.version = req.Version + 1 - uint64(r.IntN(3)) // stale, or a newer policy: general path
			st.burst = max(1, m.Burst+r.Int64N(3)-1)
			if st.version != req.Version || st.burst != m.Burst {
				general++
			}
		case 4:
			st.born, st.spill, st.owed = 0, 0, 0 // written before spill marks: general path
			general++
		case 5:
			if err := c.Set(ctx, grants, "0", time.Minute).Err(); err != nil { // no grants, but a record: general path
				t.Fatal(err)
			}
			general++
		}
		exists := kind != 0
		norm := req
		m, err = validate(op, &norm)
		if err != nil {
			t.Fatal(err)
		}
		if exists {
			raw := fmt.Sprintf("%d %d %d %d %d %d %d", st.level, st.carry, st.last, st.version, st.burst, st.rate, st.per)
			if kind != 4 {
				raw += fmt.Sprintf(" %d %d %d", st.born, st.spill, st.owed)
			}
			if err := c.Set(ctx, bucket, raw, time.Minute).Err(); err != nil {
				t.Fatal(err)
			}
		}

		call := s.Lease
		if op == OpReturn {
			call = s.Return
		}
		got, err := call(ctx, req)
		if err != nil {
			t.Fatalf("case %d (kind %d) %v %+v: %v", i, kind, op, req, err)
		}
		wantSt, want := apply(st, exists, op, &norm, m, micros(got.Now.UnixMicro()))
		if got != want {
			t.Fatalf("case %d (kind %d) %v %+v from %+v:\n lua %+v\n  Go %+v", i, kind, op, req, st, got, want)
		}
		raw, err := c.Get(ctx, bucket).Result()
		if err != nil {
			t.Fatal(err)
		}
		if w := fmt.Sprintf("%d %d %d %d %d %d %d %d %d %d", wantSt.level, wantSt.carry, wantSt.last, wantSt.version,
			wantSt.burst, wantSt.rate, wantSt.per, wantSt.born, wantSt.spill, wantSt.owed); raw != w {
			t.Fatalf("case %d (kind %d) %v %+v from %+v: state\n lua %s\n  Go %s", i, kind, op, req, st, raw, w)
		}
	}
	if general < cases/10 {
		t.Fatalf("only %d of %d cases took the general path", general, cases)
	}
	t.Logf("%d of %d cases on the general path", general, cases)
}
