// Package hooks connects leasehold's own packages through functions that
// are not public API: a package that owns a capability sets the hook in
// its init, and the layer above calls it. Users cannot import it.
package hooks

import (
	"context"
	"errors"
	"time"
)

// ErrFull marks a store failure where the server refused a write for
// want of memory (Redis OOM). Package remote wraps it into such errors;
// package breaker wants more proof that such a store is back (a full
// Redis lets writes through in spells as its clients free memory).
var ErrFull = errors.New("store out of memory")

// ReportTimeout tells the circuit breaker of a *breaker.Store that a caller
// gave up waiting for the store. Set by package breaker.
var ReportTimeout func(store any)

// StoreFailed turns an error of a script a package above ran on the client
// of a *remote.RedisStore into the store's own error (ErrUnavailable,
// ErrUnreachable or ErrCorruptState, with the key) and, where the store
// does so for its own calls, reloads the cluster's slots. Set by package
// remote.
var StoreFailed func(store any, key string, err error) error

// UpdateRecord runs update on the record at key of a *remote.MemoryStore,
// atomically, at the store's time now (µs): old is the record, or nil if
// there is none or it expired; what update returns replaces it for ttl
// when it says to write. It reports false for any other store, and only
// reports with a nil update. Tiers of stores keep their
// in-memory pools this way, so that every process of a simulated region
// shares them through the region's MemoryStore. Set by package remote.
var UpdateRecord func(ctx context.Context, store any, key string, ttl time.Duration,
	update func(old any, now int64) (v any, write bool)) (ok bool, err error)
