package hybrid

import (
	"fmt"
	"time"
)

// Source says what decided.
type Source uint8

const (
	// SourceLease: decided locally, from leased tokens or from a cached
	// "empty until" answer of the store.
	SourceLease Source = iota
	// SourceRemote: decided after a synchronous store call.
	SourceRemote
	// SourceDegraded: the store is unavailable; decided by this process's
	// local share of the limit.
	SourceDegraded
	// SourceFailOpen: the store is unavailable and the limiter admits all.
	SourceFailOpen
	// SourceFailClosed: the store is unavailable and the limiter rejects all.
	SourceFailClosed
	// SourceGrant: decided locally by the key's capacity grant (see
	// WithCapacityLeases).
	SourceGrant
	numSources
)

// String returns the source's name.
func (s Source) String() string {
	switch s {
	case SourceLease:
		return "lease"
	case SourceRemote:
		return "remote"
	case SourceDegraded:
		return "degraded"
	case SourceFailOpen:
		return "fail-open"
	case SourceFailClosed:
		return "fail-closed"
	case SourceGrant:
		return "grant"
	}
	return fmt.Sprintf("Source(%d)", int(s))
}

// Decision is the outcome of AllowN, returned by value.
type Decision struct {
	// Allowed reports whether the n tokens were admitted.
	Allowed bool
	// Limit is the limit in force.
	Limit Limit
	// Remaining estimates how many tokens the whole fleet may still admit
	// on the key now: the global bucket's level in the store's last
	// answer, refilled at the limit's rate since, plus this process's
	// unspent lease. It is an estimate (other processes' spending since
	// that answer is unknown here), never above Burst and never below what
	// this process itself can still spend without asking the store. In
	// degraded mode it is what this process's share has left.
	Remaining int64
	// RetryAfter is, when !Allowed, how long until asking again can succeed.
	RetryAfter time.Duration
	// ResetAfter is how long until the global bucket would be full if
	// nobody spent from it, as of the store's last answer for this key
	// (degraded mode: this process's share).
	ResetAfter time.Duration
	// Source says what decided.
	Source Source
}

// Mode is the limiter's relation to its store.
type Mode int32

const (
	// ModeHealthy: the store answers; decisions follow the global bucket.
	ModeHealthy Mode = iota
	// ModeDegraded: the store is unavailable; decisions follow the
	// OutageMode.
	ModeDegraded
	// ModeRecovering: the store is back; outage accounts are being settled.
	ModeRecovering
)

// String returns the mode's name.
func (m Mode) String() string {
	switch m {
	case ModeHealthy:
		return "healthy"
	case ModeDegraded:
		return "degraded"
	case ModeRecovering:
		return "recovering"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// OutageMode chooses what decides while the store is unavailable.
type OutageMode int

const (
	// OutageDegraded (the default): each key runs a local GCRA at this
	// process's share of the limit, Rate/N and Burst/N (at least 1), N the
	// fleet size.
	OutageDegraded OutageMode = iota
	// OutageFailOpen admits every request.
	OutageFailOpen
	// OutageFailClosed rejects every request.
	OutageFailClosed
)

// String returns the outage mode's name.
func (m OutageMode) String() string {
	switch m {
	case OutageDegraded:
		return "degraded"
	case OutageFailOpen:
		return "fail-open"
	case OutageFailClosed:
		return "fail-closed"
	}
	return fmt.Sprintf("OutageMode(%d)", int(m))
}
