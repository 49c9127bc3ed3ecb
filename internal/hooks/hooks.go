// Package hooks connects leasehold's own packages through functions that
// are not public API: a package that owns a capability sets the hook in
// its init, and the layer above calls it. Users cannot import it.
package hooks

// ReportTimeout tells the circuit breaker of a *breaker.Store that a caller
// gave up waiting for the store. Set by package breaker.
var ReportTimeout func(store any)
