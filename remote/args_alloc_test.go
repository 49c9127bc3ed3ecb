package remote

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/allocs"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/local"
	"github.com/redis/go-redis/v9"
)

// TestScriptArgsAllocations: the EVALSHA command of a plain lease is built
// with few allocations, since every cold decision builds one: the two keys
// as one string, and each key boxed as an argument (the call and its room
// are reused once released; the operation's name, the constants and the
// script's hash are boxed once, the limit's numbers once per limit), for
// a limit whose numbers do not fit a small integer. It was 4 for the keys
// and arguments, and go-redis's EvalSha 4 more for its command (a slice,
// the hash and the two keys boxed); then 4 with the call's room, 512
// bytes, allocated for each call.
func TestScriptArgsAllocations(t *testing.T) {
	r := Request{Policy: "p", Key: "user-1", Limit: local.Limit{Rate: 1000, Period: time.Hour, Burst: 100_000}, MaxDelay: time.Second, Version: 1, N: 5, Min: 1, Need: 1}
	var c argCache
	a := testing.AllocsPerRun(1000, func() {
		call, err := c.scriptArgs(OpLease, &r)
		if err != nil {
			t.Fatal(err)
		}
		call.release()
	})
	t.Logf("%v allocations", a)
	if a > 3 {
		t.Fatalf("scriptArgs allocates %v times, want ≤ 3", a)
	}
}

// TestLeaseAllocationsOnRealRedis: a lease on a bucket the store has not
// seen allocates at most 3 times more than go-redis does to send the same
// EVALSHA, built beforehand, and read its reply (the floor any caller of
// go-redis pays): the keys and their boxing, as TestScriptArgsAllocations
// counts them. The call's room was a 4th (512 bytes), and go-redis's
// error check on a nil error a 5th.
func TestLeaseAllocationsOnRealRedis(t *testing.T) {
	ctx := context.Background()
	c := redistest.Standalone(t).Client(t)
	s := NewRedis(c)
	run := strconv.FormatInt(time.Now().UnixNano(), 36)
	lim := local.Limit{Rate: 10, Period: time.Second, Burst: 10}
	req := func(i int) Request {
		return Request{Prefix: "alloc-" + run, Policy: "p", Key: "k" + strconv.Itoa(i), Limit: lim, Version: 1, N: 2, Min: 1, Need: 1}
	}
	// Load the script, and warm the pool's connection.
	if _, err := s.Lease(ctx, req(-1)); err != nil {
		t.Fatal(err)
	}
	// The fewest of 3 batches each (allocs.Fewest): another test's
	// goroutines can add to a batch's average under make test.
	const batches, runs = 3, 300
	const calls = batches * (runs + 1)
	// The floor: the same commands on other unseen buckets, built (and
	// their arguments boxed) outside the count.
	cmds := make([][]any, calls)
	for i := range cmds {
		r := req(calls + i)
		call, err := s.args.scriptArgs(OpLease, &r)
		if err != nil {
			t.Fatal(err)
		}
		cmds[i] = append([]any(nil), call.cmd...)
	}
	floor := allocs.Fewest(batches, runs, func(i int) {
		if err := c.Process(ctx, redis.NewCmd(ctx, cmds[i]...)); err != nil {
			t.Fatal(err)
		}
	})
	reqs := make([]Request, calls)
	for i := range reqs {
		reqs[i] = req(i)
	}
	ours := allocs.Fewest(batches, runs, func(i int) {
		res, err := s.Lease(ctx, reqs[i])
		if err != nil || res.Granted != 2 || !res.Created {
			t.Fatalf("lease: %+v, %v", res, err)
		}
	})
	// The least any command costs through go-redis: a script that takes
	// nothing and answers 1 (issue 23 asked a cold decision for at most 4
	// allocations; this is 4 on go-redis v9.23, before a decision's own).
	one, err := c.ScriptLoad(ctx, "return 1").Result()
	if err != nil {
		t.Fatal(err)
	}
	cmd := []any{"evalsha", one, 0}
	least := allocs.Fewest(batches, runs, func(int) {
		if err := c.Process(ctx, redis.NewCmd(ctx, cmd...)); err != nil {
			t.Fatal(err)
		}
	})
	t.Logf("Lease on an unseen bucket: %v allocations; go-redis's EVALSHA alone: %v; the least command through go-redis: %v", ours, floor, least)
	if ours > floor+3 {
		t.Fatalf("Lease allocates %v times, %v more than go-redis's %v for the same command; want ≤ 3 more", ours, ours-floor, floor)
	}
}
