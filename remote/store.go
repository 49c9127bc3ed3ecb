// Package remote owns the shared budget: the Store interface that leases,
// returns and charges tokens of one global token bucket per key, and two
// implementations with identical semantics. RedisStore runs every operation
// as one atomic Lua script with Redis TIME as the only clock; MemoryStore
// runs the same integer arithmetic in Go over a clock.Clock, for the
// simulator, tests and single-process use.
//
// Tiers of stores, for fleets across regions, live in package
// remote/tiered.
//
// The store knows nothing of how leased tokens are spent; that is the hybrid
// layer's job.
package remote

import (
	"context"
	"fmt"
	"github.com/leasehold/leasehold/internal/errs"
	"time"

	"github.com/leasehold/leasehold/internal/exact"
	"github.com/leasehold/leasehold/internal/keys"
	"github.com/leasehold/leasehold/local"
)

// Sentinel errors, matched with errors.Is.
var (
	// ErrInvalidKey reports an empty key, a key over MaxKeyLen bytes, or a
	// prefix containing a brace.
	ErrInvalidKey = keys.ErrInvalidKey
	// ErrInvalidPolicy reports an empty or overlong policy name, an
	// invalid tier name, or a version too large to store exactly.
	ErrInvalidPolicy = keys.ErrInvalidPolicy
	// ErrUnavailable reports that the store could not be reached or did
	// not answer in time.
	ErrUnavailable = errs.New("remote", "store unavailable")
	// ErrUnreachable reports a store that is down rather than slow: the
	// connection was refused, reset or closed, or the server said it
	// cannot serve (LOADING, CLUSTERDOWN, MASTERDOWN, OOM). It always comes
	// wrapped with ErrUnavailable; the breaker opens on the first one.
	ErrUnreachable = errs.New("remote", "store unreachable")
	// ErrCorruptState reports a bucket key that holds something leasehold
	// did not write (another type, or a foreign value).
	ErrCorruptState = errs.New("remote", "bucket state corrupt")
)

const (
	// MaxKeyLen is the longest user key accepted, in bytes.
	MaxKeyLen = keys.MaxKeyLen
	// MaxVersion is the largest policy version a store can keep exactly.
	MaxVersion = uint64(1) << 53
	// DefaultPrefix is put in front of every Redis key unless a request
	// names another.
	DefaultPrefix = keys.DefaultPrefix
)

// Op names a store operation, for Batch.
type Op int

const (
	// OpLease leases tokens (Store.Lease).
	OpLease Op = iota + 1
	// OpReturn gives unused tokens back (Store.Return).
	OpReturn
	// OpDebit charges tokens admitted elsewhere (Store.Debit).
	OpDebit
)

// String returns the operation's name.
func (o Op) String() string {
	switch o {
	case OpLease:
		return "lease"
	case OpReturn:
		return "return"
	case OpDebit:
		return "debit"
	case opGrant:
		return "grant"
	case opUngrant:
		return "ungrant"
	}
	return fmt.Sprintf("Op(%d)", int(o))
}

// Request addresses one bucket and says what to do with it.
type Request struct {
	// Prefix namespaces the store's keys; "" means DefaultPrefix.
	Prefix string
	// Policy is the policy name; buckets of different policies never mix.
	Policy string
	// Key is the caller's key, 1 to MaxKeyLen bytes of anything.
	Key string
	// Limit is the bucket's limit under Version.
	Limit local.Limit
	// Version is the policy version. A bucket at a newer version refuses
	// leases (Result.Stale); an older bucket is rescaled to Limit.
	Version uint64
	// N is the number of tokens: wanted (Lease), given back (Return) or
	// charged (Debit).
	N int64
	// Min is the fewest tokens worth granting now rather than trying to
	// future-date all N (Lease only); 0 means 1.
	Min int64
	// Need is the fewest tokens that serve the caller (Lease only, at most
	// Min; 0 means Min). A lease never refuses while Need tokens are in
	// the bucket: it grants them all (up to N), or future-dates Need within
	// MaxDelay, and a refusal's RetryAfter is the wait for Need.
	Need int64
	// MaxDelay lets a Lease on an empty bucket grant N tokens that become
	// spendable only after Result.Delay, a GCRA reservation, provided the
	// delay is at most MaxDelay. 0 never future-dates. Shaped buckets
	// (Window, Also) never future-date.
	MaxDelay time.Duration

	// Window makes Limit and every limit in Also a sliding window: at
	// most Rate tokens in any interval of length Period (Burst must equal
	// Rate), counted in WindowSlots sub-windows per Period.
	Window bool
	// Also lists more limits the bucket enforces together with Limit, of
	// the same algorithm: a lease fits all of them, in one atomic call.
	Also []local.Limit
	// Hold is how long after a Lease the caller may still spend granted
	// tokens; a sliding window counts them in the sub-window of the call
	// plus Hold, so that a window sees them whenever they are spent. At
	// most a tenth of the shortest Period. A Return names the same Hold.
	Hold time.Duration
	// Since is, for a Return to a sliding window, the store time (a
	// Result.Now) of the earliest grant the returned tokens may come
	// from: they leave the sub-window of Since plus Hold. The zero value
	// gives nothing back to windows (their tokens lapse on their own).
	Since time.Time
	// Spent is, for a Debit of a plain token bucket, every token the
	// caller admitted without the store since Mark. When Mark names the
	// bucket (its Born), the bucket charges Spent less the refill it lost
	// at its cap since the mark, which no other debit can then claim: an
	// outage that every process saw left the bucket refilling unused, a
	// partition that only some saw did not. Otherwise it charges N.
	Spent int64
	// Mark is, for a Debit, Result.Mark of the caller's last answer for
	// the bucket before it admitted without the store.
	Mark SpillMark
	// Tier names which of a policy's tiers the key is under ("" for the
	// policy's own limit); each tier's buckets are apart from the others'.
	Tier string
	// Stock, for a Lease or Return of a plain token bucket, names the
	// holder record the tokens are counted under (see Stock).
	Stock Stock

	grant *grantArgs // set for the grant operations (grants.go)
}

// Result is the bucket's answer.
type Result struct {
	// Granted is how many tokens the lease gave; 0 otherwise.
	Granted int64
	// Delay is how long after the call Granted tokens become spendable;
	// 0 unless the lease was future-dated.
	Delay time.Duration
	// Remaining is how many tokens the bucket holds after the call.
	Remaining int64
	// RetryAfter is, for a lease that granted nothing, how long until the
	// bucket holds Need tokens.
	RetryAfter time.Duration
	// ResetAfter is how long until the bucket is full.
	ResetAfter time.Duration
	// Now is the store's clock at the call.
	Now time.Time
	// Version is the bucket's policy version after the call.
	Version uint64
	// Stale reports that the request's version was older than the
	// bucket's: a lease granted nothing, and the caller should adopt
	// Version.
	Stale bool
	// Created reports that the bucket did not exist before the call: it
	// is new, expired after its TTL, or was removed by someone else (for
	// instance evicted by a Redis under memory pressure).
	Created bool
	// Binding is which limit decided, for shaped buckets: 0 for Limit, i
	// for Also[i-1]. On a refusal it is the limit with the longest wait,
	// otherwise the one with the fewest tokens left.
	Binding int
	// Mark is the bucket's spill mark after the call, for a later Debit
	// (Request.Mark); zero from stores and buckets that keep none.
	Mark SpillMark
	// Holders is how many capacity grants the bucket keeps after the call
	// (see Granter).
	Holders int
	// Held reports that a Lease's tokens are counted under the record of
	// Request.Stock's holder until its term; false for a lease without a
	// holder, or past the records the bucket keeps: then spend the
	// tokens at once.
	Held bool
}

// Stock names the record a holder's leased tokens are counted under. The
// bucket's cap is Burst less every record's tokens, so the bucket and
// what holders hold never pass Burst at any instant, and in any window w
// the fleet admits at most Burst + Rate·w, with no token decaying. A
// holder reports what it still holds on its next lease (Keep), and a
// record it does not report counts until its term ends.
type Stock struct {
	// Holder names the record: 1 to 64 bytes of letters, digits and
	// "._:-", unique among the processes sharing the store; "" for none.
	Holder string
	// Keep is, for a Lease, the tokens the holder still holds of its
	// record and goes on spending: the record becomes Keep plus what the
	// lease grants.
	Keep int64
	// Spend is, for a Lease, how many of the tokens it grants now (not
	// future-dated) the holder hands at once to the callers waiting on
	// the call: at most Spend of them are not counted under the record,
	// as a lease past the records is not.
	Spend int64
	// Seq numbers the holder's calls, rising with each Lease; a call with
	// a number no higher than the record's changes nothing. For a
	// Return, it is the number of the lease whose answer the holder last
	// had: the returned tokens come off the record only if it matches.
	Seq int64
	// Term is how long after a Lease the record counts its tokens, by
	// the store's clock (plus the lease's Delay): 1 ms to 24 h.
	Term time.Duration
	// Max is the most records the bucket keeps; 0 means 64. A lease past
	// it grants at most Need, unrecorded (Result.Held is false).
	Max int
	// Release, for a Return, says the holder holds nothing more of the
	// key (it closed, or forgot the key): its record goes if no lease
	// numbered above Seq made it, and the tokens returned (N may be 0)
	// go back up to the cap the other records leave.
	Release bool
}

// defaultMaxStock is how many stock records a bucket keeps by default.
const defaultMaxStock = 64

// Reply is one answer of a Batch.
type Reply struct {
	Result
	Err error
}

// FailedReplies is the answer of a Batch of n requests that all failed
// with err, for stores (and wrappers) that fail a batch as a whole.
func FailedReplies(n int, err error) []Reply {
	out := make([]Reply, n)
	for i := range out {
		out[i].Err = err
	}
	return out
}

// Store is a shared token-bucket budget. Implementations are safe for
// concurrent use; every call is atomic per bucket and reads the store's own
// clock.
type Store interface {
	// Lease takes up to N tokens, at least Min, from the bucket.
	Lease(ctx context.Context, r Request) (Result, error)
	// Return gives N unused tokens back, never filling past Burst.
	Return(ctx context.Context, r Request) (Result, error)
	// Debit charges N tokens admitted without a lease; the bucket may go
	// into debt.
	Debit(ctx context.Context, r Request) (Result, error)
	// Batch runs op on many buckets in as few round trips as the store
	// allows (one pipeline per Redis node). Replies are in request order.
	Batch(ctx context.Context, op Op, rs []Request) []Reply
}

// Validate reports whether r is a valid request for op, with the error
// every Store answers it with. Stores that wrap others (as tiers of
// stores do) check their requests with it.
func (r Request) Validate(op Op) error {
	if _, err := validate(op, &r); err != nil {
		return err
	}
	if r.shaped() {
		if _, err := validateShape(op, &r); err != nil {
			return err
		}
	}
	return nil
}

// validate checks a request for op; it is shared by every Store so that bad
// input gets the same error everywhere.
func validate(op Op, r *Request) (exact.Micros, error) {
	if err := validateKey(r.Prefix, r.Policy, r.Key); err != nil {
		return exact.Micros{}, err
	}
	if err := keys.ValidateTier(r.Tier); err != nil {
		return exact.Micros{}, err
	}
	if r.Version > MaxVersion {
		return exact.Micros{}, fmt.Errorf("%w: version %d above %d", ErrInvalidPolicy, r.Version, MaxVersion)
	}
	m, err := exact.Reduce(r.Limit.Rate, r.Limit.Period, r.Limit.Burst)
	if err != nil {
		return exact.Micros{}, errs.Errorf("remote", "policy %q: %w", r.Policy, err)
	}
	// A debit that names its bucket's spill mark may charge 0 when the
	// bucket cannot tell (N), as long as it spent some.
	markedDebit := op == OpDebit && r.Mark.Born != 0 && r.Spent > 0 && r.N == 0
	release := op == OpReturn && r.Stock.Release && r.N == 0
	if (r.N <= 0 && !markedDebit && !release) || r.Spent < 0 {
		return exact.Micros{}, errs.Errorf("remote", "%s %d (spent %d) on %q: %w", op, r.N, r.Spent, r.Key, local.ErrInvalidN)
	}
	switch op {
	case OpLease:
		if r.N > m.Burst {
			return exact.Micros{}, errs.Errorf("remote", "lease %d on %q, burst %d: %w", r.N, r.Key, m.Burst, local.ErrExceedsBurst)
		}
		if r.Min <= 0 {
			r.Min = 1
		}
		if r.Min > r.N {
			return exact.Micros{}, errs.Errorf("remote", "lease %q: min %d above n %d: %w", r.Key, r.Min, r.N, local.ErrInvalidN)
		}
		if r.Need <= 0 {
			r.Need = r.Min
		}
		if r.Need > r.Min {
			return exact.Micros{}, errs.Errorf("remote", "lease %q: need %d above min %d: %w", r.Key, r.Need, r.Min, local.ErrInvalidN)
		}
		if r.MaxDelay < 0 || r.MaxDelay > local.MaxTimeToFull {
			return exact.Micros{}, errs.Errorf("remote", "lease %q: max delay %v: %w", r.Key, r.MaxDelay, local.ErrInvalidLimit)
		}
	case OpReturn, OpDebit:
		if r.N > local.MaxBurst {
			return exact.Micros{}, errs.Errorf("remote", "%s %d on %q: %w", op, r.N, r.Key, local.ErrExceedsBurst)
		}
	default:
		return exact.Micros{}, errs.Errorf("remote", "unknown op %d", int(op))
	}
	if err := validateStock(op, r, m); err != nil {
		return exact.Micros{}, err
	}
	return m, nil
}

// ops holds the operations both stores define the same way over their
// own calls: do runs a bucket operation (Lua on Redis, its Go twin in
// memory) and grant a grant operation.
type ops struct {
	do    func(ctx context.Context, op Op, r Request) (Result, error)
	grant grantCaller
}

// Lease implements Store.
func (o ops) Lease(ctx context.Context, r Request) (Result, error) { return o.do(ctx, OpLease, r) }

// Return implements Store.
func (o ops) Return(ctx context.Context, r Request) (Result, error) { return o.do(ctx, OpReturn, r) }

// Debit implements Store.
func (o ops) Debit(ctx context.Context, r Request) (Result, error) { return o.do(ctx, OpDebit, r) }

// SpillMark is a point in a plain bucket's history: the bucket's
// incarnation (the store time it was made, in µs; 0 for none) and the
// refill it had lost at its cap that no debit had claimed yet. A debit
// carrying a mark is forgiven what the bucket spilled since (see
// Request.Spent).
type SpillMark struct{ Born, Spill int64 }

// maxRecords is how many records a bucket keeps for s's lease.
func (s Stock) maxRecords() int64 {
	if s.Max <= 0 {
		return defaultMaxStock
	}
	return int64(s.Max)
}

// validateStock checks r's stock record, if it names one, for op under
// limit m.
func validateStock(op Op, r *Request, m exact.Micros) error {
	st := r.Stock
	if st.Holder == "" {
		return nil
	}
	if op == OpDebit || r.shaped() || st.Release && op != OpReturn {
		return errs.Errorf("remote", "%s on %q: a stock record is for a lease or return of a plain token bucket: %w", op, r.Key, ErrInvalidGrant)
	}
	if err := validateHolder(st.Holder); err != nil {
		return err
	}
	if st.Keep < 0 || st.Keep > m.Burst || st.Spend < 0 || st.Spend > m.Burst || st.Seq < 0 || st.Seq > int64(MaxVersion) || st.Max < 0 || st.Max > 1024 ||
		op == OpLease && (st.Term < time.Millisecond || st.Term > 24*time.Hour) {
		return errs.Errorf("remote", "%s on %q: keep %d, spend %d, seq %d, term %v, max %d: %w", op, r.Key, st.Keep, st.Spend, st.Seq, st.Term, st.Max, ErrInvalidGrant)
	}
	return nil
}
