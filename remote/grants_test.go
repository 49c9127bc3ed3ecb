package remote

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/local"
)

// TestGrantTwinsAgree runs random sequences of leases, returns, debits,
// grants and ungrants by three holders, leases and returns with and
// without stock records (late calls, returns of an old record, more
// holders than the bucket keeps among them), on the script and on its Go twin,
// with terms short enough that grants expire between and within steps, and
// policy changes that end every grant.
func TestGrantTwinsAgree(t *testing.T) {
	t.Run("miniredis", func(t *testing.T) {
		c, clk, step := miniredisTwin(t, time.Microsecond, 3*time.Millisecond, 90*time.Millisecond, 700*time.Millisecond, 4*time.Second)
		grantTwinSequences(t, c, clk, 60, func(time.Time) {}, step)
	})
	t.Run("redis", func(t *testing.T) {
		c := redistest.Standalone(t).Client(t)
		clk := clock.NewManual(time.Unix(0, 0))
		grantTwinSequences(t, c, clk, 30, func(now time.Time) { clk.AdvanceTo(now) }, func(*rand.Rand) {})
	})
}

func grantTwinSequences(t *testing.T, c redis.UniversalClient, clk *clock.Manual, seqs int, at func(time.Time), step func(*rand.Rand)) {
	t.Helper()
	lua, mem := NewRedis(c), NewMemory(clk)
	ctx := context.Background()
	run := fmt.Sprint(time.Now().UnixNano())
	r := rand.New(rand.NewPCG(21, 21))
	randLimit := func() local.Limit {
		periods := []time.Duration{time.Second, 100 * time.Millisecond, time.Minute, 1500 * time.Millisecond}
		return local.Limit{Rate: 1 + r.Int64N(3000), Period: periods[r.IntN(len(periods))], Burst: 1 + r.Int64N(400)}
	}
	holders := []string{"a", "b.2", "c:3"}
	calls := map[string]int64{}
	for seq := range seqs {
		lim, version := randLimit(), uint64(1)
		key := fmt.Sprintf("gseq-%s-%d", run, seq)
		before := ""
		var mark SpillMark // of the last answer
		for i := range 60 {
			if r.IntN(20) == 0 {
				lim, version = randLimit(), version+1
			}
			req := Request{Policy: "gtwins", Key: key, Limit: lim, Version: version, N: 1 + r.Int64N(lim.Burst)}
			req.Need = 1 + r.Int64N(req.N)
			req.Min = req.Need + r.Int64N(req.N-req.Need+1)
			if r.IntN(2) == 0 {
				req.MaxDelay = time.Duration(r.Int64N(int64(2*time.Second))) / time.Microsecond * time.Microsecond
			}
			g := GrantRequest{Request: req, Holder: holders[r.IntN(len(holders))], Want: 1 + r.Int64N(GrantUnits),
				Running: r.Int64N(GrantUnits + 1), Burst: 1 + r.Int64N(50),
				Term: time.Duration(1+r.Int64N(3000)) * time.Millisecond, MaxHolders: 1 + r.IntN(3)}
			unspent := r.Int64N(60)
			op := []Op{OpLease, OpLease, OpReturn, OpDebit, opGrant, opGrant, opGrant, opUngrant}[r.IntN(8)]
			if (op == OpLease || op == OpReturn) && r.IntN(3) > 0 {
				h := holders[r.IntN(len(holders))]
				if op == OpLease && r.IntN(6) > 0 {
					calls[h]++ // else a late call: a number already used
				}
				req.Stock = Stock{Holder: h, Keep: r.Int64N(lim.Burst + 1), Spend: r.Int64N(req.Need + 1), Seq: max(calls[h]-r.Int64N(2), 0),
					Term: time.Duration(1+r.Int64N(3000)) * time.Millisecond, Max: 1 + r.IntN(4)}
				if op == OpReturn {
					req.N = 1 + r.Int64N(lim.Burst)
					if r.IntN(3) == 0 {
						req.Stock.Release, req.N = true, r.Int64N(lim.Burst)
					}
				}
			}
			if op == OpDebit && r.IntN(3) > 0 {
				// A debit of what an outage spent, forgiven what spilled
				// since a mark: the last answer's, an earlier spill, or
				// another incarnation's.
				req.Spent, req.Mark = r.Int64N(2*lim.Burst), mark
				switch r.IntN(4) {
				case 0:
					req.Mark.Spill = max(req.Mark.Spill-r.Int64N(3*lim.Burst), 0)
				case 1:
					req.Mark.Born++
				}
			}
			call := func(s interface {
				Store
				Granter
			}) (Result, error) {
				switch op {
				case OpReturn:
					return s.Return(ctx, req)
				case OpDebit:
					return s.Debit(ctx, req)
				case opGrant:
					got, err := s.Grant(ctx, g)
					got.Result.Granted, got.Result.Delay, got.Result.RetryAfter = got.Share, time.Duration(got.Burst)*time.Microsecond, time.Duration(got.Tokens)*time.Microsecond
					return got.Result, err
				case opUngrant:
					return s.Ungrant(ctx, g, unspent)
				}
				return s.Lease(ctx, req)
			}
			got, gerr := call(lua)
			if gerr == nil {
				at(got.Now)
			}
			want, werr := call(mem)
			if gerr != nil || werr != nil {
				if errors.Is(gerr, ErrNoGrants) && errors.Is(werr, ErrNoGrants) {
					continue
				}
				t.Fatalf("seq %d step %d %v %+v: lua error %v, Go error %v", seq, i, op, g, gerr, werr)
			}
			if got != want {
				t.Fatalf("seq %d step %d %v %+v:\n lua %+v\n  Go %+v\n state before %s", seq, i, op, g, got, want, before)
			}
			l, m := luaGrantState(t, c, &req), memGrantState(mem, &req)
			mem.mu.Lock()
			st := mem.mu.buckets[bucketKey(&req)].st
			mem.mu.Unlock()
			if _, held := st.gsum(); st.level+held > st.burst {
				t.Fatalf("seq %d step %d %v: level %d and held %d pass burst %d", seq, i, op, st.level, held, st.burst)
			}
			if l != m {
				t.Fatalf("seq %d step %d %v %+v: state\n lua %s\n  Go %s", seq, i, op, g, l, m)
			}
			before = l
			mark = got.Mark
			step(r)
		}
	}
}

// TestGrantDivision: the store divides its rate by proportional share of
// the wants, never hands out more than the rate, gives a newcomer free
// capacity at once and its fair share once the others have renewed twice:
// in the Go twin and in the script on a real server.
func TestGrantDivision(t *testing.T) {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	t.Run("memory", func(t *testing.T) { testGrantDivision(t, NewMemory(clk), clk.Advance) })
	// The script itself, on a real server: renewals are calls, the 10 s
	// terms outlast the test, so its clock needs no advancing.
	t.Run("redis", func(t *testing.T) {
		testGrantDivision(t, NewRedis(redistest.Standalone(t).Client(t)), func(time.Duration) {})
	})
}

func testGrantDivision(t *testing.T, s Granter, advance func(time.Duration)) {
	ctx := context.Background()
	lim := local.Limit{Rate: 1000, Period: time.Second, Burst: 100}
	policy := "div-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	ask := func(key, holder string, want, running int64) Grant {
		t.Helper()
		g, err := s.Grant(ctx, GrantRequest{Request: Request{Policy: policy, Key: key, Limit: lim, Version: 1},
			Holder: holder, Want: want, Running: running, Burst: 5, Term: 10 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	t.Run("equal wants, equal grants", func(t *testing.T) {
		got := map[string]int64{}
		for round := range 3 {
			for _, h := range []string{"a", "b", "c", "d"} {
				got[h] = ask("equal", h, GrantUnits, got[h]).Share
			}
			advance(time.Second)
			_ = round
		}
		var sum int64
		for h, sh := range got {
			if sh < GrantUnits/4*95/100 || sh > GrantUnits/4*105/100 {
				t.Errorf("holder %s: share %d, want %d ±5%%", h, sh, GrantUnits/4)
			}
			sum += sh
		}
		if sum > GrantUnits {
			t.Errorf("Σ shares %d > %d", sum, GrantUnits)
		}
	})
	t.Run("a small want is met, the spare goes to the others", func(t *testing.T) {
		got := map[string]int64{}
		wants := map[string]int64{"small": 64, "x": GrantUnits, "y": GrantUnits}
		for range 3 {
			for _, h := range []string{"small", "x", "y"} {
				got[h] = ask("uneven", h, wants[h], got[h]).Share
			}
			advance(time.Second)
		}
		if got["small"] != 64 || got["x"] != got["y"] || got["x"]+got["y"]+64 != GrantUnits {
			t.Errorf("shares %v, want small 64 and x = y = %d", got, (GrantUnits-64)/2)
		}
	})
	t.Run("a newcomer gets free capacity at once, its fair share within two renewals", func(t *testing.T) {
		got := map[string]int64{}
		for range 2 {
			for _, h := range []string{"a", "b"} {
				got[h] = ask("newcomer", h, 400, got[h]).Share
			}
		}
		if got["a"] != 400 || got["b"] != 400 {
			t.Fatalf("before: %v", got)
		}
		got["new"] = ask("newcomer", "new", GrantUnits, 0).Share
		if got["new"] != GrantUnits-800 {
			t.Fatalf("newcomer got %d at once, want the free %d", got["new"], GrantUnits-800)
		}
		// Everyone now wants all: the fair share is a third.
		for range 2 {
			for _, h := range []string{"a", "b", "new"} {
				got[h] = ask("newcomer", h, GrantUnits, got[h]).Share
			}
			advance(3 * time.Second)
		}
		for h, sh := range got {
			if sh < GrantUnits/3*95/100 || sh > GrantUnits/3*105/100 {
				t.Errorf("after two renewals %s has %d, want %d ±5%%", h, sh, GrantUnits/3)
			}
		}
	})
	t.Run("past the holder bound, no grant", func(t *testing.T) {
		for i := range defaultMaxHolders {
			if g := ask("bounded", fmt.Sprint("h", i), 10, 0); g.Share != 10 {
				t.Fatalf("holder %d: %+v", i, g)
			}
		}
		if g := ask("bounded", "one-too-many", 10, 0); g.Share != 0 || g.Holders != defaultMaxHolders {
			t.Fatalf("past the bound: %+v", g)
		}
	})
}

// TestGrantBadInput: out-of-range requests get ErrInvalidGrant, limits that
// cannot take grants ErrNoGrants, on both stores.
func TestGrantBadInput(t *testing.T) {
	ctx := context.Background()
	base := GrantRequest{Request: Request{Policy: "bad", Key: "k", Limit: local.Limit{Rate: 10, Period: time.Second, Burst: 10}, Version: 1},
		Holder: "h", Want: 1, Burst: 1, Term: time.Second}
	stores := map[string]Granter{"memory": NewMemory(clock.Real()), "redis": NewRedis(redistest.Standalone(t).Client(t))}
	for name, s := range stores {
		for _, tc := range []struct {
			name string
			edit func(*GrantRequest)
			want error
		}{
			{"empty holder", func(g *GrantRequest) { g.Holder = "" }, ErrInvalidGrant},
			{"holder with a space", func(g *GrantRequest) { g.Holder = "a b" }, ErrInvalidGrant},
			{"holder with a bar", func(g *GrantRequest) { g.Holder = "a|b" }, ErrInvalidGrant},
			{"want 0", func(g *GrantRequest) { g.Want = 0 }, ErrInvalidGrant},
			{"want above units", func(g *GrantRequest) { g.Want = GrantUnits + 1 }, ErrInvalidGrant},
			{"burst 0", func(g *GrantRequest) { g.Burst = 0 }, ErrInvalidGrant},
			{"term 0", func(g *GrantRequest) { g.Term = 0 }, ErrInvalidGrant},
			{"bad key", func(g *GrantRequest) { g.Key = "" }, ErrInvalidKey},
			{"sliding window", func(g *GrantRequest) { g.Window = true }, ErrNoGrants},
			{"too fine a limit", func(g *GrantRequest) { g.Limit = local.Limit{Rate: 999_999, Period: time.Second, Burst: 10} }, ErrNoGrants},
		} {
			g := base
			tc.edit(&g)
			if _, err := s.Grant(ctx, g); !errors.Is(err, tc.want) {
				t.Errorf("%s: %s: %v, want %v", name, tc.name, err, tc.want)
			}
		}
		if _, err := s.Ungrant(ctx, base, -1); !errors.Is(err, ErrInvalidGrant) {
			t.Errorf("%s: negative unspent: %v", name, err)
		}
	}
}

// luaGrantState is the script's bucket and grants, the grants sorted.
func luaGrantState(t *testing.T, c redis.UniversalClient, r *Request) string {
	t.Helper()
	ctx := context.Background()
	bucket, grants := bucketKeys(r)
	b, _ := c.Get(ctx, bucket).Result()
	g, _ := c.Get(ctx, grants).Result()
	parts := strings.Split(g, "|")
	slices.Sort(parts[min(1, len(parts)):])
	return b + " / " + strings.Join(parts, "|")
}

// memGrantState is the twin's, written as the script writes it.
func memGrantState(s *MemoryStore, r *Request) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.mu.buckets[bucketKey(r)].st
	out := fmt.Sprintf("%d %d %d %d %d %d %d %d %d %d / ", st.level, st.carry, st.last, st.version, st.burst, st.rate, st.per, st.born, st.spill, st.owed)
	if len(st.grants) == 0 {
		return out
	}
	parts := []string{fmt.Sprint(st.gfrac)}
	for _, g := range st.grants {
		parts = append(parts, fmt.Sprintf("%s %d %d %d %d %d %d", g.holder, g.share, g.burst, g.exp, g.want, g.stock, g.seq))
	}
	slices.Sort(parts[1:])
	return out + strings.Join(parts, "|")
}

// TestDebitForgivenBySpill: a debit that carries the mark of the caller's
// last answer is charged what it spent less the refill the bucket lost at
// its cap since then (capacity no one used), and that spill is claimed: a
// second debit on the same mark gets only what is left. A mark of another
// incarnation (the bucket expired and was made again) charges N. Lua and
// its Go twin alike.
func TestDebitForgivenBySpill(t *testing.T) {
	for _, name := range []string{"lua", "go"} {
		t.Run(name, func(t *testing.T) {
			mr := miniredis.RunT(t)
			start := time.Unix(1_700_000_000, 0)
			mr.SetTime(start)
			c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
			t.Cleanup(func() { _ = c.Close() })
			clk := clock.NewManual(start)
			var s Store = NewMemory(clk)
			if name == "lua" {
				s = NewRedis(c)
			}
			ctx := context.Background()
			at := func(d time.Duration) {
				mr.SetTime(start.Add(d))
				mr.FastForward(start.Add(d).Sub(clk.Now()))
				clk.AdvanceTo(start.Add(d))
			}
			req := Request{Policy: "spill", Key: "k", Limit: local.Limit{Rate: 10, Period: time.Second, Burst: 10}, Version: 1, N: 10, Min: 10, Need: 10}
			res, err := s.Lease(ctx, req)
			if err != nil || res.Granted != 10 || res.Mark.Born == 0 {
				t.Fatalf("lease = %+v, %v", res, err)
			}
			mark := res.Mark
			// Someone else's lease at 1.5 s keeps the bucket (a full one
			// expires a second after it filled): full at 1 s, it lost 5 at
			// its cap; by 2 s it lost 4 more.
			one := req
			one.N, one.Min, one.Need = 1, 1, 1
			at(1500 * time.Millisecond)
			if res, err := s.Lease(ctx, one); err != nil || res.Granted != 1 || res.Mark.Spill != 5 {
				t.Fatalf("lease at 1.5 s = %+v, %v; want a spill of 5", res, err)
			}
			at(2 * time.Second)
			debit := func(spent, n int64, m SpillMark) int64 {
				t.Helper()
				d := req
				d.N, d.Min, d.Need, d.Spent, d.Mark = n, 0, 0, spent, m
				res, err := s.Debit(ctx, d)
				if err != nil {
					t.Fatal(err)
				}
				return res.Remaining
			}
			if rem := debit(15, 3, mark); rem != 4 {
				t.Fatalf("15 spent, 9 spilled since the mark: %d remain, want 4 (6 charged)", rem)
			}
			// The spill is claimed: the next 15 are all charged.
			if rem := debit(15, 3, mark); rem != 0 {
				t.Fatalf("the spill claimed twice: %d remain", rem)
			}
			if res, _ := s.Lease(ctx, one); res.Granted != 0 || res.RetryAfter != 1200*time.Millisecond {
				t.Fatalf("after a debt of 11: %+v, want a refusal for 1.2 s", res)
			}
			other := mark
			other.Born++
			at(4 * time.Second) // the debt paid, 9 back
			if rem := debit(30, 2, other); rem != 7 {
				t.Fatalf("a mark of another bucket: %d remain, want 7 (N = 2 charged)", rem)
			}
		})
	}
}
