package remote

import (
	"context"
	"fmt"
	"time"

	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/exact"
)

// Capacity grants. A holder with sustained demand on a key asks the bucket
// for a share of its rate (in units of Rate/GrantUnits) and a small burst,
// valid for a term counted by the store's clock. The bucket refills
// everyone else with what the live grants leave, Rate·(1 − Σshare) up to
// Burst − Σburst, piecewise: an expired grant gives its rate back from its
// own expiry. So at every instant the bucket's refill plus the grants'
// rates is Rate, and its cap plus the grants' bursts is Burst, and in any
// window w the fleet admits at most Burst + Rate·w, whoever is cut off
// from the store, as long as no holder spends past its term.
//
// Division by wants is Doorman's proportional share: wants that fit the
// rate are met; past it, a want up to the equal share (GrantUnits ÷
// holders) is met and the spare goes to the others in proportion to what
// they want beyond the equal share. A grant never takes more than the
// others' grants leave. A holder's rate rises above what it reports it
// runs at only while the bucket's level is not negative (no future-dated
// tokens or debt out, which were timed at the rate before); it falls only
// to what the holder reports it runs at, so a holder that never saw its lowered grant (a lost
// reply, a partition) is counted at the rate it spends.

// GrantUnits is how finely a capacity grant divides a bucket's rate: a
// grant's share is in units of Rate/GrantUnits.
const GrantUnits = grantUnits

const (
	grantUnits = 1024
	// maxGrantRatePer bounds rate·per (the limit in lowest terms, per in
	// µs) of a bucket that takes grants, so that the refill in per·G units
	// stays exact in a double.
	maxGrantRatePer = int64(1) << 53 / (grantUnits * grantUnits)
	// defaultMaxHolders is how many grants a bucket keeps unless a
	// request says otherwise; past it, processes lease batches.
	defaultMaxHolders = 16
	// grantRetry bounds the wait a refusal names when the grants leave
	// the bucket no rate: holders give rate back at their renewals, which
	// the bucket cannot foresee.
	grantRetry = time.Second
	// maxHolderLen bounds a holder's name.
	maxHolderLen = 64
)

// The grant operations, internal to the bucket script.
const (
	opGrant Op = iota + 100
	opUngrant
)

// ErrNoGrants reports a limit that cannot take capacity grants exactly: a
// sliding window, several limits, or rate·period (in lowest terms, period
// in µs) above 2^33.
var ErrNoGrants = errs.New("remote", "limit takes no capacity grants")

// GrantRequest asks for, renews or gives back a capacity grant.
type GrantRequest struct {
	// Request names the bucket and its limit (Prefix, Policy, Tier, Key,
	// Limit, Version); its N, Min, Need and MaxDelay are not used.
	Request
	// Holder names the grant: 1 to 64 bytes of letters, digits and
	// "._:-", unique among the processes sharing the store.
	Holder string
	// Want is the share wanted, 1 to GrantUnits.
	Want int64
	// Running is the share the holder spends at now: its last grant's
	// Share, 0 for a new grant. The store counts the holder at no less.
	Running int64
	// Burst is the local burst the grant asks for (at least 1): a new one,
	// or a renewal's up to it, is given while the grants' bursts fit the
	// bucket's Burst. A renewal asking less than its grant has gives the
	// rest up: the holder must have capped its own spending to Burst
	// before it sent the call (local.Bucket.Resize), so that a process
	// joining a key whose holders took all of Burst is not kept out of
	// flow for good.
	Burst int64
	// Term is how long the grant lasts from the call, by the store's
	// clock.
	Term time.Duration
	// MaxHolders is the most grants the bucket keeps; 0 means 16.
	MaxHolders int
}

// Grant is a capacity grant: spend at most Burst + Share·Rate/GrantUnits
// per Period (a GCRA at that rate and burst), until Term after the call was
// sent.
type Grant struct {
	// Share is the rate granted, in units of Rate/GrantUnits; 0 when the
	// others' grants leave nothing (the holder is kept, its want counted
	// at their renewals) or the bucket keeps MaxHolders others.
	Share int64
	// Burst is the grant's local burst: the most tokens the holder may
	// have in hand.
	Burst int64
	// Tokens is how many tokens the holder has in hand at once: what the
	// bucket's level held of the burst the grant gained at this call.
	Tokens int64
	// Term is how long the grant lasts from the call.
	Term time.Duration
	// Result is the bucket's answer: Remaining, ResetAfter, Now,
	// Version, Stale, Created and Holders.
	Result
}

// Granter is a store that keeps capacity grants. RedisStore and
// MemoryStore are Granters for plain token buckets.
type Granter interface {
	// Grant creates or renews the holder's grant.
	Grant(ctx context.Context, r GrantRequest) (Grant, error)
	// Ungrant ends the holder's grant and gives back unspent tokens of
	// its burst (at most the grant's Burst).
	Ungrant(ctx context.Context, r GrantRequest, unspent int64) (Result, error)
}

var (
	_ Granter = (*RedisStore)(nil)
	_ Granter = (*MemoryStore)(nil)
)

// grantArgs are a grant operation's arguments beyond the bucket's.
type grantArgs struct {
	holder     string
	running    int64
	term       int64 // µs
	maxHolders int64
	burst      int64
}

// grantOp validates r for op and returns the bucket request to run: N is
// the want (opGrant) or the unspent tokens (opUngrant).
func grantOp(op Op, r GrantRequest, unspent int64) (Request, grantArgs, exact.Micros, error) {
	req := r.Request
	req.grant = nil
	if err := validateHolder(r.Holder); err != nil {
		return req, grantArgs{}, exact.Micros{}, err
	}
	if req.shaped() {
		return req, grantArgs{}, exact.Micros{}, fmt.Errorf("%w: %q is a shaped limit", ErrNoGrants, req.Policy)
	}
	g := grantArgs{holder: r.Holder, running: r.Running, term: r.Term.Microseconds(), maxHolders: int64(r.MaxHolders), burst: r.Burst}
	if g.maxHolders <= 0 {
		g.maxHolders = defaultMaxHolders
	}
	switch op {
	case opGrant:
		req.N = r.Want
		if r.Want < 1 || r.Want > GrantUnits || r.Running < 0 || r.Running > GrantUnits {
			return req, g, exact.Micros{}, errs.Errorf("remote", "grant %q: want %d, running %d: %w", req.Key, r.Want, r.Running, ErrInvalidGrant)
		}
		if r.Burst < 1 || r.Term < time.Millisecond || r.Term > 24*time.Hour || g.maxHolders > 64 {
			return req, g, exact.Micros{}, errs.Errorf("remote", "grant %q: burst %d, term %v, holders %d: %w", req.Key, r.Burst, r.Term, g.maxHolders, ErrInvalidGrant)
		}
	case opUngrant:
		if unspent < 0 {
			return req, g, exact.Micros{}, errs.Errorf("remote", "ungrant %q: unspent %d: %w", req.Key, unspent, ErrInvalidGrant)
		}
		req.N = unspent + 1 // validate wants N ≥ 1; the script is told unspent
	}
	m, err := validate(OpReturn, &req)
	if err != nil {
		return req, g, m, err
	}
	if op == opUngrant {
		req.N = unspent
	}
	if m.Rate > maxGrantRatePer/m.Per {
		return req, g, m, fmt.Errorf("%w: %q: rate %d per %d µs", ErrNoGrants, req.Policy, m.Rate, m.Per)
	}
	return req, g, m, nil
}

// ErrInvalidGrant reports a grant request out of range: a want or running
// share outside 1..GrantUnits, a burst below 1, a term outside 1 ms to
// 24 h, or a holder name that is empty, too long or not of letters,
// digits and "._:-".
var ErrInvalidGrant = errs.New("remote", "invalid grant request")

func validateHolder(h string) error {
	if h == "" || len(h) > maxHolderLen {
		return errs.Errorf("remote", "holder %q: %w", h, ErrInvalidGrant)
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == ':' || c == '-') {
			return errs.Errorf("remote", "holder %q: %w", h, ErrInvalidGrant)
		}
	}
	return nil
}

// grantCaller runs one grant operation on a store.
type grantCaller func(ctx context.Context, op Op, r GrantRequest, unspent int64) (Result, error)

// Grant implements Granter.
func (o ops) Grant(ctx context.Context, r GrantRequest) (Grant, error) {
	res, err := o.grant(ctx, opGrant, r, 0)
	if err != nil {
		return Grant{}, err
	}
	return grantFrom(res, r), nil
}

// Ungrant implements Granter.
func (o ops) Ungrant(ctx context.Context, r GrantRequest, unspent int64) (Result, error) {
	res, err := o.grant(ctx, opUngrant, r, unspent)
	if err != nil {
		return Result{}, err
	}
	res.Granted, res.Delay = 0, 0
	return res, nil
}

func (s *RedisStore) grantCall(ctx context.Context, op Op, r GrantRequest, unspent int64) (Result, error) {
	req, g, m, err := grantOp(op, r, unspent)
	if err != nil {
		return Result{}, err
	}
	call := newBucketCall(&req)
	call.cmd = append(call.cmd, op.arg(), req.N, 1, m.Rate, m.Per, m.Burst, req.Version, 0, -maxDebt, ttlMarginArg, 1,
		g.holder, g.running, g.term, g.maxHolders, g.burst)
	key := call.keys[0]
	v, err := s.eval(ctx, &call.scriptCall)
	if err != nil {
		return Result{}, s.failed(key, err)
	}
	defer call.release()
	return parseReply(key, v)
}

// grantFrom reads a grant reply: the share in Granted, the burst in Delay
// and the first tokens in RetryAfter (as µs; the script's reply has no
// other fields for them).
func grantFrom(res Result, r GrantRequest) Grant {
	g := Grant{Share: res.Granted, Burst: res.Delay.Microseconds(), Tokens: res.RetryAfter.Microseconds(), Result: res}
	if g.Share > 0 || g.Burst > 0 {
		g.Term = r.Term
	}
	g.Result.Granted, g.Result.Delay, g.Result.RetryAfter = 0, 0, 0
	return g
}

func (s *MemoryStore) grantCall(ctx context.Context, op Op, r GrantRequest, unspent int64) (Result, error) {
	req, g, m, err := grantOp(op, r, unspent)
	if err != nil {
		return Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	req.grant = &g
	return s.run(op, &req, m, nil), nil
}
