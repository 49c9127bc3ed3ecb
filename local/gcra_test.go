package local

import (
	"errors"
	"math"
	"math/big"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

type step struct {
	at        time.Duration
	n         int64
	wantOK    bool
	wantLeft  int64
	wantRetry time.Duration // checked when !wantOK
}

var implementations = []struct {
	name string
	new  func(Limit) (taker, error)
}{
	{"gcra", func(l Limit) (taker, error) { return NewBucket(l) }},
	{"mutex", func(l Limit) (taker, error) { return newMutexBucket(l) }},
}

func run(t *testing.T, lim Limit, steps []step) {
	t.Helper()
	for _, impl := range implementations {
		b, err := impl.new(lim)
		if err != nil {
			t.Fatalf("%s: new(%v): %v", impl.name, lim, err)
		}
		for i, s := range steps {
			got, err := b.TakeAt(int64(s.at), s.n)
			if err != nil {
				t.Fatalf("%s step %d: TakeAt(%v, %d): %v", impl.name, i, s.at, s.n, err)
			}
			if got.Allowed != s.wantOK || got.Remaining != s.wantLeft {
				t.Errorf("%s step %d: TakeAt(%v, %d) = ok %v left %d, want ok %v left %d",
					impl.name, i, s.at, s.n, got.Allowed, got.Remaining, s.wantOK, s.wantLeft)
			}
			if !s.wantOK && s.wantRetry != 0 && got.RetryAfter != s.wantRetry {
				t.Errorf("%s step %d: TakeAt(%v, %d).RetryAfter = %v, want %v", impl.name, i, s.at, s.n, got.RetryAfter, s.wantRetry)
			}
		}
	}
}

func TestTakeAtSequences(t *testing.T) {
	t.Parallel()
	ms := time.Millisecond
	tests := []struct {
		name  string
		lim   Limit
		steps []step
	}{
		{"burst then refill", Limit{Rate: 10, Period: time.Second, Burst: 3}, []step{
			{0, 1, true, 2, 0},
			{0, 2, true, 0, 0},
			{0, 1, false, 0, 100 * ms},
			{99 * ms, 1, false, 0, 1 * ms},
			{100 * ms, 1, true, 0, 0},
			{350 * ms, 2, true, 0, 0},
			{350 * ms, 1, false, 0, 50 * ms},
			{10 * time.Second, 3, true, 0, 0},
		}},
		{"n equal to burst on a full bucket", Limit{Rate: 1, Period: time.Hour, Burst: 5}, []step{
			{0, 5, true, 0, 0},
			{time.Hour - 1, 1, false, 0, 1},
			{time.Hour, 1, true, 0, 0},
		}},
		{"one per year", Limit{Rate: 1, Period: 365 * 24 * time.Hour, Burst: 1}, []step{
			{0, 1, true, 0, 0},
			{364 * 24 * time.Hour, 1, false, 0, 24 * time.Hour},
			{365 * 24 * time.Hour, 1, true, 0, 0},
		}},
		{"a billion per second, burst 1e12", Limit{Rate: 1e9, Period: time.Second, Burst: 1e12}, []step{
			{0, 1e12, true, 0, 0},
			{0, 1, false, 0, 1},
			{1, 1, true, 0, 0},
			{1001, 1000, true, 0, 0},
			{1001, 1, false, 0, 1},
			{1000*time.Second + 1001, 1e12, true, 0, 0},
		}},
		{"large n", Limit{Rate: 100, Period: time.Second, Burst: 100}, []step{
			{0, 60, true, 40, 0},
			{0, 41, false, 40, 10 * ms},
			{10 * ms, 41, true, 0, 0},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			run(t, tt.lim, tt.steps)
		})
	}
}

func TestTimeGoingBackwardsStaysConservative(t *testing.T) {
	t.Parallel()
	run(t, Limit{Rate: 1, Period: time.Second, Burst: 2}, []step{
		{10 * time.Second, 2, true, 0, 0},
		{5 * time.Second, 1, false, 0, 0},
		{11 * time.Second, 1, true, 0, 0},
	})
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	year := 365 * 24 * time.Hour
	limits := []struct {
		name string
		lim  Limit
	}{
		{"zero rate", Limit{Rate: 0, Period: time.Second, Burst: 1}},
		{"negative rate", Limit{Rate: -1, Period: time.Second, Burst: 1}},
		{"zero period", Limit{Rate: 1, Period: 0, Burst: 1}},
		{"negative period", Limit{Rate: 1, Period: -time.Second, Burst: 1}},
		{"zero burst", Limit{Rate: 1, Period: time.Second, Burst: 0}},
		{"negative burst", Limit{Rate: 1, Period: time.Second, Burst: -5}},
		{"sub-microsecond period", Limit{Rate: 1, Period: 1500 * time.Nanosecond, Burst: 1}},
		{"burst 1e12 at one per millennium", Limit{Rate: 1, Period: 1000 * year, Burst: 1e12}},
		{"burst beyond 2^50", Limit{Rate: 1e9, Period: time.Second, Burst: 1 << 51}},
		{"no exact microsecond form", Limit{Rate: 999999937, Period: 99999989 * time.Microsecond, Burst: 1}},
		{"max int64 everywhere", Limit{Rate: math.MaxInt64, Period: math.MaxInt64 / 1000 * 1000, Burst: math.MaxInt64}},
	}
	for _, tt := range limits {
		if _, err := NewBucket(tt.lim); !errors.Is(err, ErrInvalidLimit) {
			t.Errorf("%s: NewBucket(%v) error = %v, want ErrInvalidLimit", tt.name, tt.lim, err)
		}
	}
	b, err := NewBucket(PerSecond(10))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int64{0, -1, math.MinInt64} {
		if _, err := b.TakeAt(0, n); !errors.Is(err, ErrInvalidN) {
			t.Errorf("TakeAt(0, %d) error = %v, want ErrInvalidN", n, err)
		}
	}
	if _, err := b.TakeAt(0, 11); !errors.Is(err, ErrExceedsBurst) {
		t.Errorf("TakeAt(0, 11) error = %v, want ErrExceedsBurst", err)
	}
}

// TestConcurrentExactBound hammers one bucket from many goroutines on a
// shared fake timeline and checks the exact bound.
func TestConcurrentExactBound(t *testing.T) {
	t.Parallel()
	lim := Limit{Rate: 1000, Period: time.Second, Burst: 50}
	b, err := NewBucket(lim)
	if err != nil {
		t.Fatal(err)
	}
	var now, admitted atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 20000; i++ {
				t := now.Add(1000) // 1µs per call per goroutine, shared
				if r, _ := b.TakeAt(t, 1); r.Allowed {
					admitted.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Duration(now.Load())
	bound := lim.Burst + lim.TokensIn(elapsed)
	if got := admitted.Load(); got > bound || got < bound-1 {
		t.Fatalf("admitted %d over %v, want within [%d, %d]", got, elapsed, bound-1, bound)
	}
}

func TestTakeAtAllocatesNothing(t *testing.T) {
	b, err := NewBucket(PerSecond(1e6))
	if err != nil {
		t.Fatal(err)
	}
	var now int64
	if a := testing.AllocsPerRun(1000, func() { now += 1000; _, _ = b.TakeAt(now, 1) }); a != 0 {
		t.Fatalf("TakeAt allocates %v per call, want 0", a)
	}
}

// FuzzBucketTakeAt checks, for any limit and any sequence of takes and time
// jumps, that the admitted total never exceeds the exact bound computed with
// big rationals, and that remaining never exceeds burst.
func FuzzBucketTakeAt(f *testing.F) {
	f.Add(int64(10), int64(1e9), int64(3), []byte{1, 2, 3, 200, 4})
	f.Add(int64(1e9), int64(1e9), int64(1e12), []byte{255, 0, 255, 1})
	f.Add(int64(7), int64(3e6), int64(2), []byte{9, 9, 9, 9, 9, 9})
	f.Fuzz(func(t *testing.T, rate, periodMicros, burst int64, ops []byte) {
		lim := Limit{Rate: rate, Period: time.Duration(periodMicros) * time.Microsecond, Burst: burst}
		if periodMicros <= 0 || periodMicros > math.MaxInt64/1000 {
			return
		}
		b, err := NewBucket(lim)
		if err != nil {
			if !errors.Is(err, ErrInvalidLimit) {
				t.Fatalf("NewBucket(%v) = %v, not ErrInvalidLimit", lim, err)
			}
			return
		}
		now, start := int64(1<<40), int64(1<<40)
		var admitted int64
		for i, op := range ops {
			now += int64(op) * int64(op) * 997 // varied jumps, including 0
			n := int64(op)%burst + 1
			if i%2 == 1 {
				n = 1
			}
			r, err := b.TakeAt(now, n)
			if err != nil {
				t.Fatalf("TakeAt(%d, %d): %v", now, n, err)
			}
			if r.Remaining < 0 || r.Remaining > burst {
				t.Fatalf("Remaining %d outside [0, %d]", r.Remaining, burst)
			}
			if r.Allowed {
				admitted += n
			} else if r.RetryAfter <= 0 {
				t.Fatalf("rejected with RetryAfter %v", r.RetryAfter)
			}
		}
		// bound = burst + rate·elapsed/period, exactly.
		bound := new(big.Rat).SetFrac(big.NewInt(rate), big.NewInt(int64(lim.Period)))
		bound.Mul(bound, new(big.Rat).SetInt64(now-start))
		bound.Add(bound, new(big.Rat).SetInt64(burst))
		if new(big.Rat).SetInt64(admitted).Cmp(bound) > 0 {
			t.Fatalf("admitted %d > bound %s", admitted, bound.FloatString(3))
		}
	})
}

func BenchmarkTakeAt(b *testing.B) {
	bk, err := NewBucket(PerSecond(1e9))
	if err != nil {
		b.Fatal(err)
	}
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		var now int64
		for i := 0; i < b.N; i++ {
			now += 10
			_, _ = bk.TakeAt(now, 1)
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		var now atomic.Int64
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				_, _ = bk.TakeAt(now.Add(10), 1)
			}
		})
	})
}

func TestEmptyRefillsFromZero(t *testing.T) {
	t.Parallel()
	b, err := NewBucket(Limit{Rate: 10, Period: time.Second, Burst: 5})
	if err != nil {
		t.Fatal(err)
	}
	now := int64(time.Hour)
	b.Empty(now)
	if got := b.Tokens(now); got != 0 {
		t.Fatalf("Tokens after Empty = %d, want 0", got)
	}
	if r, _ := b.TakeAt(now, 1); r.Allowed || r.RetryAfter != 100*time.Millisecond {
		t.Fatalf("TakeAt after Empty = %+v, want rejected, retry 100ms", r)
	}
	if got := b.Tokens(now + int64(300*time.Millisecond)); got != 3 {
		t.Fatalf("Tokens 300ms after Empty = %d, want 3", got)
	}
}

// TestOweGoesIntoDebtNoFurtherThanBy: Owe takes what the bucket holds and
// then owes, refusing takes until the refill has paid; it never owes what
// the refill would not pay by its deadline.
func TestOweGoesIntoDebtNoFurtherThanBy(t *testing.T) {
	t.Parallel()
	ms := int64(time.Millisecond)
	for _, tc := range []struct {
		name      string
		spent     int64 // taken at 0 before Owe
		owe, by   int64 // Owe(0, by, owe)
		want      int64 // tokens Owe took
		firstTake int64 // ms after 0 when one token is admitted again
	}{
		{"within the burst", 0, 3, 1000 * ms, 3, 0},
		{"past the burst, into debt", 0, 8, 1000 * ms, 8, 400},
		{"capped by what refills by by", 5, 20, 1000 * ms, 10, 1100},
		{"a deadline passed owes nothing", 5, 3, 0, 0, 100},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := NewBucket(Limit{Rate: 10, Period: time.Second, Burst: 5}) // 100 ms a token
			if err != nil {
				t.Fatal(err)
			}
			if tc.spent > 0 {
				if r, _ := b.TakeAt(0, tc.spent); !r.Allowed {
					t.Fatalf("TakeAt(0, %d) refused", tc.spent)
				}
			}
			if got := b.Owe(0, tc.by, tc.owe); got != tc.want {
				t.Fatalf("Owe(0, %v, %d) = %d, want %d", time.Duration(tc.by), tc.owe, got, tc.want)
			}
			if first := firstAdmission(b); first != tc.firstTake {
				t.Fatalf("first token admitted at %d ms, want %d", first, tc.firstTake)
			}
		})
	}
}

// firstAdmission takes one token from b at each millisecond from 0 and
// returns the first millisecond it was admitted, -1 if none by 2 s.
func firstAdmission(b *Bucket) int64 {
	ms := int64(time.Millisecond)
	for at := int64(0); at <= 2000*ms; at += ms {
		if r, _ := b.TakeAt(at, 1); r.Allowed {
			return at / ms
		}
	}
	return -1
}

// TestResizeKeepsTokensAndDebt: a resized bucket holds what the old one
// held, at most its new burst, owes what the old one owed, refills at the
// same rate to its new burst, and the old one admits nothing more.
func TestResizeKeepsTokensAndDebt(t *testing.T) {
	t.Parallel()
	ms := int64(time.Millisecond)
	for _, tc := range []struct {
		name      string
		spent     int64 // taken at 0 (Owe past the burst: debt)
		burst     int64 // the new burst
		want      int64 // tokens the new bucket holds at 0
		firstTake int64 // ms after 0 when one token is admitted again, if want is 0
	}{
		{"shrunk below what it holds", 1, 5, 5, 0},
		{"shrunk above what it holds", 6, 5, 4, 0},
		{"grown", 2, 20, 8, 0},
		{"in debt", 14, 5, 0, 500}, // 4 tokens of debt: 400 ms, then 100 ms for one
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := NewBucket(Limit{Rate: 10, Period: time.Second, Burst: 10}) // 100 ms a token
			if err != nil {
				t.Fatal(err)
			}
			if got := b.Owe(0, 10_000*ms, tc.spent); got != tc.spent {
				t.Fatalf("Owe(0, %d) took %d", tc.spent, got)
			}
			nb, err := b.Resize(0, tc.burst)
			if err != nil {
				t.Fatal(err)
			}
			if got := nb.Tokens(0); got != tc.want {
				t.Fatalf("the resized bucket holds %d, want %d", got, tc.want)
			}
			if r, _ := b.TakeAt(0, 1); r.Allowed {
				t.Fatal("the old bucket admitted after Resize")
			}
			if nb.Limit().Burst != tc.burst || nb.Tokens(int64(time.Hour)) != tc.burst {
				t.Fatalf("the resized bucket's burst is %d, refilled %d; want %d", nb.Limit().Burst, nb.Tokens(int64(time.Hour)), tc.burst)
			}
			if tc.want == 0 {
				if first := firstAdmission(nb); first != tc.firstTake {
					t.Fatalf("first admission %d ms after the resize, want %d", first, tc.firstTake)
				}
			}
		})
	}
	if _, err := (&Bucket{lim: Limit{Rate: 10, Period: time.Second, Burst: 10}}).Resize(0, 0); !errors.Is(err, ErrInvalidLimit) {
		t.Fatalf("Resize to burst 0: %v, want ErrInvalidLimit", err)
	}
}
