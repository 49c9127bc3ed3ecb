package hybrid

import (
	"context"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/remote"
	"github.com/stretchr/testify/require"
)

// costEvent is one change of what a fleet has charged: +estimate when a
// charge is admitted, actual − estimate when it is settled.
type costEvent struct {
	at    time.Time
	delta int64
}

// TestSettledCostsKeepTheBound: 4 limiters with their own clients on real
// Redis, 4 workers each, charge an estimate of 100 on one key of 5 000/s
// burst 500 (above a lease, so extras are debited unless refunds left
// tokens in the lease), work 0–10 ms, and settle an actual cost drawn from
// 10% to 300% of the estimate (mean 155%: the fleet always wants more than
// the limit). Every charge and settle is recorded. At every event the
// costs settled plus the estimates of the work running are at most
// Burst + Rate·t plus the extra of the work that can run at once (16 ×
// 2 × 100 = 3 200); after the load the bucket's debt is paid from refills
// within debt ÷ Rate; and the fleet settles at least 90% of Rate·t.
func TestSettledCostsKeepTheBound(t *testing.T) {
	if testing.Short() {
		t.Skip("2 s of load per case")
	}
	const (
		estimate = 100
		workers  = 4
		procs    = 4
	)
	lim := Limit{Rate: 5000, Period: time.Second, Burst: 500}
	// Extras on a key holding flow its grant owes: the share of Rate·t
	// is 90.6–101.9% idle, 74.4% once beside make test's load (a grant in
	// debt refuses until its rate has paid it).
	cases := backends("settle", "tenant:{5}:settle")
	for i := range cases {
		cases[i].firstMost = 0.6
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := runPolicy("settle-"+tc.name, lim)
			lims := newFleet(t, procs, p, tc.dial, tc.opts...)
			var mu sync.Mutex
			var events []costEvent
			record := func(at time.Time, d int64) {
				mu.Lock()
				events = append(events, costEvent{at, d})
				mu.Unlock()
			}
			ctx := context.Background()
			start := time.Now()
			stop := start.Add(2 * time.Second)
			var wg sync.WaitGroup
			for i, l := range lims {
				for w := range workers {
					wg.Add(1)
					go func() {
						defer wg.Done()
						rng := rand.New(rand.NewPCG(uint64(i), uint64(w)))
						for time.Now().Before(stop) {
							asked := time.Now()
							ch, err := l.ChargeN(ctx, tc.key, estimate)
							if err != nil {
								t.Error(err)
								return
							}
							if !ch.Allowed {
								runtime.Gosched()
								continue
							}
							record(asked, estimate)
							time.Sleep(time.Duration(rng.IntN(10_000)) * time.Microsecond) // the work
							actual := int64(float64(estimate) * (0.1 + 2.9*rng.Float64()))
							record(time.Now(), actual-estimate)
							if err := ch.Settle(actual); err != nil {
								t.Error(err)
								return
							}
						}
					}()
				}
			}
			wg.Wait()
			end := time.Now()
			slices.SortFunc(events, func(a, b costEvent) int { return a.at.Compare(b.at) })
			var total, worst int64
			var worstAt time.Duration
			for _, ev := range events {
				total += ev.delta
				if over := total - (lim.Burst + lim.TokensIn(ev.at.Sub(start))); over > worst {
					worst, worstAt = over, ev.at.Sub(start)
				}
			}
			bound := lim.Burst + lim.TokensIn(end.Sub(start))
			s := fleetStats(lims)
			t.Logf("%s: settled %d in %v against Burst + Rate·t = %d (%.1f%%); worst excess %d at %v (allowed %d); %d charges, %d store calls (%.1f per 1 000 charges), %d debited",
				tc.name, total, end.Sub(start).Round(time.Millisecond), bound, 100*float64(total)/float64(bound),
				worst, worstAt.Round(time.Millisecond), procs*workers*2*estimate, s.Admitted, s.StoreCalls,
				1000*float64(s.StoreCalls)/float64(max(s.Admitted, 1)), s.TokensDebited)
			if worst > procs*workers*2*estimate {
				t.Fatalf("settled costs %d over Burst + Rate·t, more than the extra of the work running at once (%d)", worst, procs*workers*2*estimate)
			}
			if float64(total) < tc.firstMost*float64(lim.TokensIn(end.Sub(start))) {
				t.Fatalf("settled %d, under %.0f%% of Rate·t (%d)", total, 100*tc.firstMost, lim.TokensIn(end.Sub(start)))
			}
			// The debt left is paid from refills: the bucket is back to a
			// level of 0 or more within debt ÷ Rate (+100 ms of slack for
			// the polls).
			for _, l := range lims {
				require.NoError(t, l.Close(ctx))
			}
			st := remote.NewRedis(tc.dial(t))
			closed := time.Now()
			b, err := st.Peek(ctx, lims[0].cfg.prefix, p.Name, tc.key)
			require.NoError(t, err)
			debt := max(-b.Level, 0)
			within := lim.DurationFor(debt) + 100*time.Millisecond
			for b.Level < 0 {
				if time.Since(closed) > within {
					t.Fatalf("debt %d not paid %v after the load (level %d)", debt, within, b.Level)
				}
				time.Sleep(10 * time.Millisecond) // polling with a deadline
				b, err = st.Peek(ctx, lims[0].cfg.prefix, p.Name, tc.key)
				require.NoError(t, err)
			}
			t.Logf("%s: debt %d at the end, paid %v later (stated: within %v)", tc.name, debt, time.Since(closed).Round(time.Millisecond), within)
		})
	}
}

// TestChargeRefundKeepsEveryWindow: a settled charge's refund must not
// refill the bucket under a grant someone took after it. A (alone, as
// the fleet count says) charges 8 of a bucket of 10 at 10/s and works
// 1.1 s, long enough for the bucket to refill; B then takes the full
// bucket as its lease and spends a token; A settles at 1. Given back to
// the bucket whole, the 7 refunded let C take them while B spends its 9:
// 15 admitted, a window 4 over Burst + Rate·w (measured with the refund
// sent whole). What the refill since the charge would have lost at the
// cap lapses instead, and no window is over.
func TestChargeRefundKeepsEveryWindow(t *testing.T) {
	t.Parallel()
	chargeRefundWindow(t)
}

func chargeRefundWindow(t *testing.T, opts ...Option) {
	var adm []admission
	admit := admitOn(&adm)
	lim := Limit{Rate: 10, Period: time.Second, Burst: 10}
	a, b, c := loneTrio(t, "refund-window-"+time.Now().Format("150405.000000"), lim, opts...)
	asked := time.Now()
	ctx := context.Background()
	ch, err := a.ChargeN(ctx, "k", 8)
	require.NoError(t, err)
	require.True(t, ch.Allowed)
	adm = append(adm, admission{asked, time.Now()}) // the 1 it will use
	time.Sleep(1100 * time.Millisecond)             // the work: the bucket refills
	admit(b, 1)
	require.NoError(t, ch.Settle(1))
	// A refund sent to the bucket goes in the background: send what A
	// has queued before C asks.
	require.NoError(t, a.settle.sendNow(ctx))
	admit(b, 100)
	admit(c, 100)
	worst, _, at := worstWindow(adm, lim, adm[0].asked)
	t.Logf("%d admitted; A gave back %d; worst window %+d against Burst + Rate·w (at %v)",
		len(adm), a.Stats().TokensReturned, worst, at.Round(time.Millisecond))
	require.LessOrEqual(t, worst, int64(0), "a window over Burst + Rate·w")
}
