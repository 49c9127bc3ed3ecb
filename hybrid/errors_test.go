package hybrid_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/keys"
	"github.com/leasehold/leasehold/internal/testkit/logtest"
	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/remote"
	"github.com/leasehold/leasehold/remote/tiered"
)

// prefixes counts the package prefixes ("hybrid: ", "remote: ", ...) in
// msg, and reports whether msg starts with one.
func prefixes(msg string) (n int, leading bool) {
	for _, p := range errs.Packages {
		n += strings.Count(msg, p+": ")
		leading = leading || strings.HasPrefix(msg, p+": ")
	}
	return n, leading
}

// TestErrorMessagesHaveOnePrefix walks every sentinel path a user can
// reach, through every layer that wraps it, and fails on a message with
// no package prefix in front or with more than one.
func TestErrorMessagesHaveOnePrefix(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	store := remote.NewRedis(c)
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	lim, err := hybrid.New(store, hybrid.Policy{Name: "api", Limit: hybrid.PerSecond(10)}, hybrid.WithClock(clk))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lim.Close(ctx) })
	allow := func(key string, n int64) error { _, err := lim.AllowN(ctx, key, n); return err }
	dead := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { _ = dead.Close() })
	req := remote.Request{Policy: "p", Key: "k", Limit: local.Limit{Rate: 1, Period: time.Second, Burst: 1}, Version: 1, N: 1}

	cases := []struct {
		name   string
		err    func() error
		target error
	}{
		{"allow: empty key", func() error { return allow("", 1) }, hybrid.ErrInvalidKey},
		{"allow: long key", func() error { return allow(strings.Repeat("k", 2000), 1) }, hybrid.ErrInvalidKey},
		{"allow: n 0", func() error { return allow("k", 0) }, hybrid.ErrInvalidN},
		{"allow: n over burst", func() error { return allow("k", 11) }, hybrid.ErrExceedsBurst},
		{"new: bad limit", func() error {
			_, err := hybrid.New(store, hybrid.Policy{Name: "x", Limit: hybrid.Limit{Rate: -1, Period: time.Second, Burst: 1}})
			return err
		}, hybrid.ErrInvalidLimit},
		{"new: empty policy name", func() error { _, err := hybrid.New(store, hybrid.Policy{Limit: hybrid.PerSecond(1)}); return err }, hybrid.ErrInvalidPolicy},
		{"new: bad option", func() error {
			_, err := hybrid.New(store, hybrid.Policy{Name: "x", Limit: hybrid.PerSecond(1)}, hybrid.WithMaxKeys(-1))
			return err
		}, hybrid.ErrInvalidOption},
		{"set policy: stale", func() error {
			if err := lim.SetPolicy(ctx, hybrid.Policy{Name: "api", Limit: hybrid.PerSecond(10), Version: 3}); err != nil {
				return err
			}
			return lim.SetPolicy(ctx, hybrid.Policy{Name: "api", Limit: hybrid.PerSecond(10), Version: 2})
		}, hybrid.ErrStalePolicy},
		{"store: unreachable", func() error { _, err := remote.NewRedis(dead).Lease(ctx, req); return err }, remote.ErrUnreachable},
		{"store: corrupt", func() error {
			mr.Set(keys.Bucket("", "p", "", "k"), "garbage")
			_, err := store.Lease(ctx, req)
			return err
		}, remote.ErrCorruptState},
		{"store: bad tier", func() error { r := req; r.Tier = "a b"; return r.Validate(remote.OpLease) }, remote.ErrInvalidPolicy},
		{"breaker: open", func() error {
			b := breaker.NewStore(remote.NewRedis(dead), breaker.Settings{})
			var err error
			for range 10 {
				_, err = b.Lease(ctx, req)
			}
			return err
		}, breaker.ErrOpen},
		{"tiered: bad option", func() error {
			_, err := tiered.New("eu", remote.NewMemory(clk), remote.NewMemory(clk), tiered.WithRefillGap(0))
			return err
		}, nil},
		{"local: bad limit", func() error { return local.Limit{Rate: 1, Period: time.Nanosecond, Burst: 1}.Validate() }, local.ErrInvalidLimit},
		{"closed", func() error { _ = lim.Close(ctx); return allow("k", 1) }, hybrid.ErrClosed},
	}
	for _, tc := range cases {
		err := tc.err()
		if err == nil {
			t.Errorf("%s: no error", tc.name)
			continue
		}
		if tc.target != nil && !errors.Is(err, tc.target) {
			t.Errorf("%s: %v does not match %v", tc.name, err, tc.target)
		}
		if n, leading := prefixes(err.Error()); n != 1 || !leading {
			t.Errorf("%s: %q has %d package prefixes (leading: %v), want one in front", tc.name, err, n, leading)
		}
	}
}

// TestInvalidKeyLoggedOnce: Allow on an empty key answers false with no
// error to look at, so the limiter says why at WARN, once.
func TestInvalidKeyLoggedOnce(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	var logs logtest.Buffer // New's store check logs from the background
	l, err := hybrid.New(remote.NewRedis(c), hybrid.Policy{Name: "api", Limit: hybrid.PerSecond(5)},
		hybrid.WithLogger(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close(context.Background())
	for range 3 {
		if l.Allow(context.Background(), "") {
			t.Fatal(`Allow("") = true, want false`)
		}
	}
	if _, err := l.AllowN(context.Background(), "", 1); !errors.Is(err, hybrid.ErrInvalidKey) {
		t.Fatalf(`AllowN("") error = %v, want ErrInvalidKey`, err)
	}
	if got := strings.Count(logs.String(), "invalid key refused"); got != 1 {
		t.Fatalf("invalid key logged %d times, want 1:\n%s", got, logs.String())
	}
}
