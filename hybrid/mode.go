package hybrid

import (
	"sync"
	"sync/atomic"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/reconcile"
	"github.com/sony/gobreaker/v2"
)

// transition is a mode change for the caller to report once it holds no
// lock (logging runs user code: the slog handler).
type transition struct{ from, to Mode }

func (t transition) changed() bool { return t.from != t.to }

// modeTracker owns the limiter's Mode: it follows the breaker, and after
// an outage that left accounts open it holds ModeRecovering while a
// settlement runs. Transitions are serialized by mu; Mode reads are
// atomic.
type modeTracker struct {
	store      *breaker.Store
	reported   atomic.Int32 // Mode last reported
	recovering atomic.Bool
	mu         struct {
		sync.Mutex
		// settling cancels the running settlement; nil when none runs.
		settling func() []reconcile.Item
	}
}

func newModeTracker(store *breaker.Store) *modeTracker {
	m := &modeTracker{store: store}
	m.reported.Store(int32(m.fromBreaker()))
	return m
}

func (m *modeTracker) fromBreaker() Mode {
	if m.store.State() == gobreaker.StateClosed {
		return ModeHealthy
	}
	return ModeDegraded
}

// mode is Limiter.Mode.
func (m *modeTracker) mode() Mode {
	now := m.fromBreaker()
	if now == ModeHealthy && m.recovering.Load() {
		return ModeRecovering
	}
	return now
}

// check compares the breaker with the mode last reported. When the store
// is back after an outage and owed reports open accounts, it calls settle
// (which must not block) to start the settlement and enters Recovering.
func (m *modeTracker) check(owed func() bool, settle func() (cancel func() []reconcile.Item)) transition {
	now, prev := m.fromBreaker(), Mode(m.reported.Load())
	if now == prev || (prev == ModeRecovering && now == ModeHealthy) {
		return transition{prev, prev} // the settlement reports the end of recovery
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now, prev = m.fromBreaker(), Mode(m.reported.Load())
	if prev == ModeRecovering && now == ModeHealthy {
		return transition{prev, prev}
	}
	if now == ModeHealthy && prev == ModeDegraded && m.mu.settling == nil && owed() {
		m.recovering.Store(true)
		m.mu.settling = settle()
		return m.setLocked(ModeRecovering)
	}
	return m.setLocked(now)
}

// settled ends a recovery: the mode follows the breaker again.
func (m *modeTracker) settled() transition {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.mu.settling = nil
	m.recovering.Store(false)
	return m.setLocked(m.fromBreaker())
}

// cancelSettlement stops a running settlement and returns what it had not
// sent yet.
func (m *modeTracker) cancelSettlement() []reconcile.Item {
	m.mu.Lock()
	cancel := m.mu.settling
	m.mu.Unlock()
	if cancel == nil {
		return nil
	}
	return cancel()
}

func (m *modeTracker) setLocked(to Mode) transition {
	return transition{Mode(m.reported.Swap(int32(to))), to}
}
