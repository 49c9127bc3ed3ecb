package inflight

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/keys"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
)

// TestSlots plays one sequence on the Go twin and on the script on a real
// server: holdings never sum past the limit, a lower hold gives slots
// back, a holder that stops calling gets nothing back until its term ends
// and then frees its slots, a lowered limit keeps what is held and grants
// no more, and a call under an older policy version is decided by the
// newer limit.
func TestSlots(t *testing.T) {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	t.Run("memory", func(t *testing.T) {
		testSlots(t, memoryBackend{remote.NewMemory(clk)}, func(term time.Duration, _ func() bool) { clk.Advance(term) })
	})
	t.Run("redis", func(t *testing.T) {
		b, err := backendOf(remote.NewRedis(redistest.Standalone(t).Client(t)))
		if err != nil {
			t.Fatal(err)
		}
		// Real time passes: wait for the term by polling with a deadline.
		testSlots(t, b, func(term time.Duration, done func() bool) {
			deadline := time.Now().Add(term + 2*time.Second)
			for !done() {
				if time.Now().After(deadline) {
					t.Fatal("slots did not come back after the term")
				}
				time.Sleep(5 * time.Millisecond) // polling with a deadline
			}
		})
	})
}

func testSlots(t *testing.T, b backend, wait func(term time.Duration, done func() bool)) {
	ctx := context.Background()
	key := keys.Slots("", "slots-"+strconv.FormatInt(time.Now().UnixNano(), 36), "", "k")
	version := uint64(1)
	ask := func(holder string, hold, limit int64, term time.Duration) slotReply {
		t.Helper()
		res, err := b.slots(ctx, slotRequest{key: key, holder: holder, hold: hold, limit: limit, version: version, term: term})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	long := time.Hour
	for i, st := range []struct {
		holder          string
		hold, limit     int64
		version         uint64
		wantHeld, inUse int64
		wantLimit       int64
	}{
		{"a", 5, 10, 1, 5, 5, 10},
		{"b", 8, 10, 1, 5, 10, 10}, // what a leaves
		{"c", 1, 10, 1, 0, 10, 10}, // nothing free
		{"a", 2, 10, 1, 2, 7, 10},  // gives 3 back
		{"b", 8, 10, 1, 8, 10, 10}, // takes them
		{"b", 8, 6, 2, 8, 10, 6},   // a lowered limit keeps what is held
		{"b", 9, 6, 2, 8, 10, 6},   // and grants no more
		{"b", 3, 6, 2, 3, 5, 6},    // gives back
		{"c", 2, 10, 1, 1, 6, 6},   // an older version gets what is free under the newer limit
		{"a", 0, 6, 2, 0, 4, 6},    // gives everything back
		{"g", 0, 10, 1, 0, 4, 6},   // the older version did not replace the limit
	} {
		version = st.version
		res := ask(st.holder, st.hold, st.limit, long)
		if res.held != st.wantHeld || res.inUse != st.inUse || res.limit != st.wantLimit || res.version != 2 && st.version == 2 {
			t.Fatalf("step %d: %s asks %d of %d (v%d): %+v; want held %d, in use %d, limit %d",
				i, st.holder, st.hold, st.limit, st.version, res, st.wantHeld, st.inUse, st.wantLimit)
		}
	}
	version = 3
	// A holder that stops calling keeps its slots until its term ends.
	term := 100 * time.Millisecond
	if res := ask("d", 10, 10, term); res.held != 6 {
		t.Fatalf("d holds %d, want the free 6", res.held)
	}
	if res := ask("e", 1, 10, long); res.held != 0 {
		t.Fatalf("e got %d while d's term runs", res.held)
	}
	wait(term, func() bool { return ask("e", 1, 10, long).held == 1 })
	if res := ask("e", 7, 10, long); res.held != 6 || res.inUse != 10 {
		t.Fatalf("after d's term e holds %d (in use %d), want 6 (10)", res.held, res.inUse)
	}
	// Holders learn that others wait for slots: c asked 2 and holds 1,
	// e asked 7 and holds 6.
	if res := ask("f", 2, 10, long); res.held != 0 || res.waiting != 2 {
		t.Fatalf("f: %+v, want nothing held, c's 1 and e's 1 waiting", res)
	}
	if res := ask("e", 6, 10, long); res.waiting != 3 {
		t.Fatalf("e: %d waiting, want c's 1 and f's 2", res.waiting)
	}
	ask("e", 4, 10, long)
	if res := ask("f", 2, 10, long); res.held != 2 || res.waiting != 1 {
		t.Fatalf("f after e gave 2 back: %+v, want 2 held, c's 1 waiting", res)
	}
	if res := ask("e", 4, 10, long); res.waiting != 1 {
		t.Fatalf("e: %d waiting after f got its 2, want c's 1", res.waiting)
	}
}

// TestPolicyRecordTwins: the policy script and its Go twin keep the newer
// version, read without writing, and replace a record someone else
// overwrote.
func TestPolicyRecordTwins(t *testing.T) {
	c := redistest.Standalone(t).Client(t)
	rb, err := backendOf(remote.NewRedis(c))
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range map[string]backend{"memory": memoryBackend{remote.NewMemory(clock.Real())}, "redis": rb} {
		ctx := context.Background()
		key := keys.SlotsPolicy("", "rec-"+name)
		for i, st := range []struct {
			rec     string
			version uint64
			want    string
		}{
			{"", 0, ""},
			{"2 10", 2, "2 10"},
			{"1 99", 1, "2 10"}, // older: kept
			{"2 99", 2, "2 10"}, // same version: the first wins
			{"", 0, "2 10"},
			{"3 5 free=1", 3, "3 5 free=1"},
		} {
			got, err := b.policy(ctx, key, st.rec, st.version)
			if err != nil || got != st.want {
				t.Fatalf("%s step %d: %q, %v; want %q", name, i, got, err, st.want)
			}
		}
	}
	key := keys.SlotsPolicy("", "rec-clobbered")
	if err := c.Set(context.Background(), key, "garbage", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if got, err := rb.policy(context.Background(), key, "4 4", 4); err != nil || got != "4 4" {
		t.Fatalf("a newer policy over an overwritten record: %q, %v", got, err)
	}
}

// TestSlotsCorrupt: a slots key that holds another type or a record
// leasehold did not write gets ErrCorruptState, as does a policy key of
// another type.
func TestSlotsCorrupt(t *testing.T) {
	c := redistest.Standalone(t).Client(t)
	b, err := backendOf(remote.NewRedis(c))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	key := keys.Slots("", "bad-slots", "", "clobbered")
	for _, clobber := range []func() error{
		func() error { return c.Set(ctx, key, "x", 0).Err() },
		func() error { c.Del(ctx, key); return c.HSet(ctx, key, "h", "garbage").Err() },
		func() error { c.Del(ctx, key); return c.HSet(ctx, key, "#v", "one 2").Err() },
	} {
		if err := clobber(); err != nil {
			t.Fatal(err)
		}
		_, err := b.slots(ctx, slotRequest{key: key, holder: "h", hold: 1, limit: 1, version: 1, term: time.Second})
		if !errors.Is(err, remote.ErrCorruptState) {
			t.Errorf("clobbered slots key: %v, want ErrCorruptState", err)
		}
	}
	pkey := keys.SlotsPolicy("", "bad-slots")
	if err := c.HSet(ctx, pkey, "f", "v").Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := b.policy(ctx, pkey, "", 0); !errors.Is(err, remote.ErrCorruptState) {
		t.Errorf("policy key of another type: %v, want ErrCorruptState", err)
	}
}
