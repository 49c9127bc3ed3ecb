package tiered

import (
	"github.com/leasehold/leasehold/internal/errs"

	"github.com/leasehold/leasehold/remote"
)

// regionState is a region's record of a policy (keys.Region) in its own
// store: the world's weight as the last beat read it, the weight the
// region last reported, and the beat claim, so that one process of the
// region beats at a time. regionLua keeps it in Redis and the apply
// methods below, its Go twin, in a MemoryStore.
type regionState struct {
	world int64  // every region's live limiters, as the last beat read it
	own   int64  // the weight this region last reported
	claim micros // until then a beat is in flight
	down  micros // when a beat last failed; 0 once one gets through
}

// regionReply is the record after an operation.
type regionReply struct {
	claimed bool
	now     micros
	st      regionState
}

// A regionOp is one operation on a region record, as a poolOp is on a pool.
type regionOp interface {
	name() string
	encode() []any
	apply(st *regionState, now micros) (claimed bool)
}

// regionBeat claims the region's beat if none is in flight.
type regionBeat struct{ Claim micros }

func (regionBeat) name() string    { return "beat" }
func (o regionBeat) encode() []any { return []any{int64(o.Claim)} }
func (o regionBeat) apply(st *regionState, now micros) bool {
	if now < st.claim {
		return false
	}
	st.claim = now + o.Claim
	return true
}

// regionFail records a beat that did not get through.
type regionFail struct{}

func (regionFail) name() string  { return "fail" }
func (regionFail) encode() []any { return nil }
func (regionFail) apply(st *regionState, now micros) bool {
	st.down = now
	return false
}

// regionWeigh records a beat that got through: the world's weight it read
// and the region's own it reported.
type regionWeigh struct{ World, Own int64 }

func (regionWeigh) name() string    { return "weigh" }
func (o regionWeigh) encode() []any { return []any{o.World, o.Own} }
func (o regionWeigh) apply(st *regionState, _ micros) bool {
	st.world, st.own, st.down = o.World, o.Own, 0
	return false
}

// parseRegionReply reads regionLua's reply: {claimed, now, world, own,
// claim, down}.
func parseRegionReply(key string, v []int64) (regionReply, error) {
	if len(v) != 6 {
		return regionReply{}, errs.Errorf("tiered", "region %q: %w: reply of %d fields", key, remote.ErrCorruptState, len(v))
	}
	return regionReply{claimed: v[0] == 1, now: micros(v[1]),
		st: regionState{world: v[2], own: v[3], claim: micros(v[4]), down: micros(v[5])}}, nil
}

// applyRegion runs op on st at now, as regionLua does.
func applyRegion(st regionState, op regionOp, now micros) (regionState, regionReply) {
	claimed := op.apply(&st, now)
	return st, regionReply{claimed: claimed, now: now, st: st}
}
