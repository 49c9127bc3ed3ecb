package remote

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/keys"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
)

// TestSlots plays one sequence on the Go twin and on the script on a real
// server: holdings never sum past the limit, a lower Hold gives slots
// back, a holder that stops calling gets nothing back until its term ends
// and then frees its slots, a lowered limit keeps what is held and grants
// no more.
func TestSlots(t *testing.T) {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	t.Run("memory", func(t *testing.T) {
		testSlots(t, NewMemory(clk), func(term time.Duration, _ func() bool) { clk.Advance(term) })
	})
	t.Run("redis", func(t *testing.T) {
		// Real time passes: wait for the term by polling with a deadline.
		testSlots(t, NewRedis(redistest.Standalone(t).Client(t)), func(term time.Duration, done func() bool) {
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

func testSlots(t *testing.T, s Slotter, wait func(term time.Duration, done func() bool)) {
	ctx := context.Background()
	policy := "slots-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	ask := func(holder string, hold, limit int64, term time.Duration) SlotResult {
		t.Helper()
		res, err := s.Slots(ctx, SlotRequest{Policy: policy, Key: "k", Holder: holder, Hold: hold, Limit: limit, Term: term})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	long := time.Hour
	for i, st := range []struct {
		holder          string
		hold, limit     int64
		wantHeld, inUse int64
	}{
		{"a", 5, 10, 5, 5},
		{"b", 8, 10, 5, 10}, // what a leaves
		{"c", 1, 10, 0, 10}, // nothing free
		{"a", 2, 10, 2, 7},  // gives 3 back
		{"b", 8, 10, 8, 10}, // takes them
		{"b", 8, 6, 8, 10},  // a lowered limit keeps what is held
		{"b", 9, 6, 8, 10},  // and grants no more
		{"b", 3, 6, 3, 5},   // gives back
		{"c", 2, 6, 1, 6},   // what is free under the new limit
		{"a", 0, 6, 0, 4},   // gives everything back
	} {
		if res := ask(st.holder, st.hold, st.limit, long); res.Held != st.wantHeld || res.InUse != st.inUse {
			t.Fatalf("step %d: %s asks %d of %d: held %d, in use %d; want %d, %d", i, st.holder, st.hold, st.limit, res.Held, res.InUse, st.wantHeld, st.inUse)
		}
	}
	// A holder that stops calling keeps its slots until its term ends.
	term := 100 * time.Millisecond
	if res := ask("d", 10, 10, term); res.Held != 6 {
		t.Fatalf("d holds %d, want the free 6", res.Held)
	}
	if res := ask("e", 1, 10, long); res.Held != 0 {
		t.Fatalf("e got %d while d's term runs", res.Held)
	}
	wait(term, func() bool { return ask("e", 1, 10, long).Held == 1 })
	if res := ask("e", 7, 10, long); res.Held != 6 || res.InUse != 10 {
		t.Fatalf("after d's term e holds %d (in use %d), want 6 (10)", res.Held, res.InUse)
	}
	// Holders learn that others wait for slots: c asked 2 and holds 1,
	// e asked 7 and holds 6.
	if res := ask("f", 2, 10, long); res.Held != 0 || res.Waiting != 2 {
		t.Fatalf("f: %+v, want nothing held, c's 1 and e's 1 waiting", res)
	}
	if res := ask("e", 6, 10, long); res.Waiting != 3 {
		t.Fatalf("e: %d waiting, want c's 1 and f's 2", res.Waiting)
	}
	ask("e", 4, 10, long)
	if res := ask("f", 2, 10, long); res.Held != 2 || res.Waiting != 1 {
		t.Fatalf("f after e gave 2 back: %+v, want 2 held, c's 1 waiting", res)
	}
	if res := ask("e", 4, 10, long); res.Waiting != 1 {
		t.Fatalf("e: %d waiting after f got its 2, want c's 1", res.Waiting)
	}
}

// TestSlotsBadInput: requests out of range get ErrInvalidSlots; a slots
// key that holds another type or a record leasehold did not write gets
// ErrCorruptState.
func TestSlotsBadInput(t *testing.T) {
	c := redistest.Standalone(t).Client(t)
	stores := map[string]Slotter{"memory": NewMemory(clock.Real()), "redis": NewRedis(c)}
	ok := SlotRequest{Policy: "bad-slots", Key: "k", Holder: "h", Hold: 1, Limit: 1, Term: time.Second}
	for name, s := range stores {
		for _, tc := range []struct {
			name string
			edit func(*SlotRequest)
			want error
		}{
			{"negative hold", func(r *SlotRequest) { r.Hold = -1 }, ErrInvalidSlots},
			{"no limit", func(r *SlotRequest) { r.Limit = 0 }, ErrInvalidSlots},
			{"short term", func(r *SlotRequest) { r.Term = time.Microsecond }, ErrInvalidSlots},
			{"long term", func(r *SlotRequest) { r.Term = 25 * time.Hour }, ErrInvalidSlots},
			{"bad holder", func(r *SlotRequest) { r.Holder = "a b" }, ErrInvalidSlots},
			{"empty key", func(r *SlotRequest) { r.Key = "" }, ErrInvalidKey},
		} {
			r := ok
			tc.edit(&r)
			if _, err := s.Slots(context.Background(), r); !errors.Is(err, tc.want) {
				t.Errorf("%s, %s: %v, want %v", name, tc.name, err, tc.want)
			}
		}
	}
	key := keys.Slots("", ok.Policy, "", "clobbered")
	for _, clobber := range []func() error{
		func() error { return c.Set(context.Background(), key, "x", 0).Err() },
		func() error {
			c.Del(context.Background(), key)
			return c.HSet(context.Background(), key, "h", "garbage").Err()
		},
	} {
		if err := clobber(); err != nil {
			t.Fatal(err)
		}
		r := ok
		r.Key = "clobbered"
		if _, err := stores["redis"].Slots(context.Background(), r); !errors.Is(err, ErrCorruptState) {
			t.Errorf("clobbered slots key: %v, want ErrCorruptState", err)
		}
	}
}
