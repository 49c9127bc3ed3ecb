package faulttest

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Shopify/toxiproxy/v2/toxics"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// TestSilentLinkLeavesNoGoroutine: a link made silent and mended 40
// times, under traffic and behind a latency toxic, fails calls while
// silent, serves them once mended, and leaves no goroutine of toxiproxy's
// once its proxy stops. (With toxiproxy's timeout toxic removed to mend
// it, 3 runs left blocked pipes in the first; make test failed in CI on
// one such pipe.)
func TestSilentLinkLeavesNoGoroutine(t *testing.T) {
	srv := redistest.NewServer(t)
	before := goleak.IgnoreCurrent()
	proxy := startProxies(t, srv.Addr, "flappy")[0]
	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(
		`{"name": "slow", "type": "latency", "stream": "downstream", "attributes": {"latency": 1}}`)); err != nil {
		t.Fatal(err)
	}
	// Short timeouts and many connections, so that replies are in flight
	// whenever the link changes.
	rdb := redis.NewClient(&redis.Options{Addr: proxy.Listen, ReadTimeout: 3 * time.Millisecond, MaxRetries: -1, PoolSize: 64})
	var stop atomic.Bool
	var silentFailed atomic.Int64
	var silent atomic.Bool
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				if rdb.Ping(context.Background()).Err() != nil && silent.Load() {
					silentFailed.Add(1)
				}
			}
		}()
	}
	for range 40 {
		silentLink(t, proxy, true)
		silent.Store(true)
		time.Sleep(15 * time.Millisecond)
		silent.Store(false)
		silentLink(t, proxy, false)
		time.Sleep(15 * time.Millisecond)
	}
	stop.Store(true)
	wg.Wait()
	if silentFailed.Load() == 0 {
		t.Error("no call failed while the link was silent")
	}
	mended := redis.NewClient(&redis.Options{Addr: proxy.Listen, MaxRetries: -1})
	if err := mended.Ping(context.Background()).Err(); err != nil {
		t.Errorf("mended link: %v", err)
	}
	mended.Close()
	rdb.Close()
	proxy.Stop()
	if err := goleak.Find(before); err != nil {
		t.Fatal(err)
	}
}

// silence is toxiproxy's timeout toxic with no timeout, less its Cleanup:
// it drops every byte and keeps the connection. Removing a toxic with a
// Cleanup takes a path in toxiproxy (v2.5.0 to v2.12.0) that closes the
// removed stage without rewiring the stage before it, which then blocks
// for good on its next chunk (TestSilentLinkLeavesNoGoroutine); without
// one, removal rewires the chain as for any other toxic. (Setting the
// timeout toxic's toxicity to 0 instead is a data race in toxiproxy.)
type silence struct{}

func init() { toxics.Register("silence", new(silence)) }

// Pipe drops what comes in until the toxic is interrupted or the link
// closes.
func (silence) Pipe(stub *toxics.ToxicStub) {
	for {
		select {
		case <-stub.Interrupt:
			return
		case c := <-stub.Input:
			if c == nil {
				stub.Close()
				return
			}
		}
	}
}
