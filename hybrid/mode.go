package hybrid

import (
	"context"
	"log/slog"
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
	cfg        *config
	stats      *counters
	policy     *policyTracker // names the policy in the log
	store      *breaker.Store
	reported   atomic.Int32 // Mode last reported
	recovering atomic.Bool
	mu         struct {
		sync.Mutex
		// settling cancels the running settlement; nil when none runs.
		settling func() []reconcile.Item
	}
}

// recoverer starts the settlement of an outage (the limiter's
// settlement).
type recoverer interface {
	// owed reports whether the outage left accounts open.
	owed() bool
	// start starts the settlement without blocking and returns what
	// cancels it.
	start() (cancel func() []reconcile.Item)
}

func newModeTracker(cfg *config, stats *counters, policy *policyTracker, store *breaker.Store) *modeTracker {
	m := &modeTracker{cfg: cfg, stats: stats, policy: policy, store: store}
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
// is back after an outage that left accounts open, it starts r's
// settlement and enters Recovering.
func (m *modeTracker) check(r recoverer) transition {
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
	if now == ModeHealthy && prev == ModeDegraded && m.mu.settling == nil && r.owed() {
		m.recovering.Store(true)
		m.mu.settling = r.start()
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

// report counts and logs t, a transition check or settled returned; call
// it with no lock held (the slog handler is user code).
func (m *modeTracker) report(t transition) {
	if !t.changed() {
		return
	}
	m.stats.modeChanges.Add(1)
	m.cfg.logger.LogAttrs(context.Background(), slog.LevelWarn, "leasehold: mode change",
		slog.String("policy", m.policy.load().Name), slog.String("from", t.from.String()), slog.String("to", t.to.String()))
}

// checkMode notices breaker state changes (on the slow path and at every
// sweep) and starts a recovery when the store is back and the outage left
// accounts open. Mode changes are logged after every lock is released.
func (l *Limiter) checkMode() {
	t := l.modes.check(&l.settle)
	switch {
	case !t.changed():
	case t.to == ModeDegraded:
		if t.from != ModeRecovering {
			// From recovering, the outage goes on (the recovery never
			// finished): its shares keep what they have.
			l.outage.began(l.cfg.now())
		}
		// Reserved tokens fall due during the outage, which the degraded
		// share already covers: spending them, or giving them back once
		// the store answers (after the outage's debt is charged), would
		// count those tokens twice. They are dropped.
		l.keys.each(func(e *account) { l.stats.tokensDropped.Add(l.leaser.pace.cancel(e)) })
	case t.from == ModeDegraded:
		if l.outage.ended(l.cfg.now()) {
			l.bg.After(0, l.holdBeat)
		}
	}
	l.modes.report(t)
}
