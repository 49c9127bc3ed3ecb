package remote

import (
	"cmp"
	"context"
	"errors"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/exact"
	"github.com/leasehold/leasehold/internal/hooks"
	"github.com/leasehold/leasehold/internal/redisopts"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisStore is a Store on Redis, Redis Cluster or Sentinel through a
// go-redis UniversalClient. Each operation is one EVALSHA of bucketLua
// (falling back to EVAL after SCRIPT FLUSH or on a fresh node), atomic per
// bucket, with Redis TIME as the clock. Batch sends one pipeline per node.
//
// Build the client with ContextTimeoutEnabled: true. Without it go-redis
// bounds an in-flight read by ReadTimeout (3 s by default, per retry), not
// by the context, so a hung server holds each call far longer than the
// store timeout; checkClient reports the mistake and hybrid.New logs it.
//
// A RedisStore is safe for concurrent use. The zero value is not usable;
// call NewRedis. It does not own the client: closing the client is the
// caller's job.
type RedisStore struct {
	ops
	c redis.UniversalClient
	// reload asks a Cluster client to refresh its slot map; nil for other
	// clients or when WithClusterReload(false).
	reload func()
	// ap coalesces every call into pipelines; set by WithAutoPipeline(true)
	// when the client has one.
	ap *redis.AutoPipeliner
	// over pipelines the calls a node's pool cannot carry at once; set by
	// default (nil when WithAutoPipeline was given).
	over *overflow
	// args keeps the last limit's numbers boxed as script arguments.
	args argCache
}

var _ Store = (*RedisStore)(nil)

// RedisOption configures a RedisStore.
type RedisOption interface{ apply(*redisConfig) }

type redisConfig struct {
	clusterReload bool
	pipe          pipeMode
}

type redisOptionFunc func(*redisConfig)

func (f redisOptionFunc) apply(c *redisConfig) { f(c) }

// WithClusterReload sets whether a call that fails to reach a node makes a
// *redis.ClusterClient reload its slot map at once. go-redis reloads it
// on MOVED and ASK replies, but not on connection errors: after a master
// dies and its replica is promoted, calls keep going to the dead address
// until the periodic reload. The reload is lazy and deduplicated by
// go-redis, so a burst of errors costs one CLUSTER SLOTS. The default is
// true.
func WithClusterReload(on bool) RedisOption {
	return redisOptionFunc(func(c *redisConfig) { c.clusterReload = on })
}

// WithAutoPipeline sets whether calls share round trips through the
// client's autopipeliner (go-redis's AsyncAutoPipeline, one pipeline per
// node on Cluster). Each call still honors its context: a caller stops
// waiting at its deadline, though a command already queued is still sent.
// The client's AutoPipelineOptions, if set, configure the pipeliner, which
// the client owns and shares.
//
//   - Unset (the default), a call takes a pooled connection while at most
//     the node's Options.PoolSize calls are in flight on it (go-redis's
//     default, 10 per CPU, when unset); a call beyond them, which would
//     wait for a connection, goes through the pipeliner (built at the
//     first such call) with the others beyond. A lone call never waits for
//     a batch. Calls are counted per node on Cluster and per shard on
//     Ring. Measured on 100 000 Zipf keys with 256 goroutines and a pool
//     of 64 (TestZipfRatios, medians of 5 rounds): 5.67× redis_rate's
//     decisions per second against 3.02× with the pool alone, p99 13.7 ms
//     against 18.0 (redis_rate: 13.3); at 1 and 16 goroutines no call
//     overflows and nothing changes.
//   - true sends every call through the pipeliner. Measured on the same
//     keys (BenchmarkLimiters, impl=hybrid+autopipeline), each decision
//     was 1.4× slower than on the pool alone at 1 goroutine and 3.0× at
//     16 (the pool's connections carry calls in parallel), and 2.1× faster
//     at 256. A pipeliner that waits after each flush to gather more
//     (AutoPipelineOptions.MaxFlushDelay, one pipeline per short tick)
//     makes a lone call wait for the tick: with 100 µs, 625 µs per
//     decision at 1 goroutine against 27 µs flushing at once
//     (impl=hybrid+autopipeline-tick; docs/benchmarks.md has the run).
//   - false sends every call on a pooled connection: a call beyond the
//     pool waits for a connection (impl=hybrid+pool).
func WithAutoPipeline(on bool) RedisOption {
	return redisOptionFunc(func(c *redisConfig) {
		c.pipe = pipeNever
		if on {
			c.pipe = pipeAlways
		}
	})
}

// NewRedis returns a Store over c.
func NewRedis(c redis.UniversalClient, opts ...RedisOption) *RedisStore {
	cfg := redisConfig{clusterReload: true}
	for _, o := range opts {
		o.apply(&cfg)
	}
	s := &RedisStore{c: c}
	s.ops = ops{do: s.do, grant: s.grantCall}
	if cc, ok := c.(*redis.ClusterClient); ok && cfg.clusterReload {
		s.reload = func() { cc.ReloadState(context.Background()) }
	}
	switch cfg.pipe {
	case pipeAlways:
		// A client that cannot build one (a closed client, a bad
		// AutoPipelineOptions) still serves calls one by one.
		if ap, err := c.AsyncAutoPipeline(); err == nil {
			s.ap = ap
		}
	case pipeOverflow:
		s.over = newOverflow(c)
	}
	return s
}

// checkClient reports settings of c that keep the store from meeting its
// deadlines, for the client types go-redis provides.
func checkClient(c redis.UniversalClient) error {
	if enabled, _, known := redisopts.Of(c); known && !enabled {
		return errs.New("remote", "go-redis client without ContextTimeoutEnabled: in-flight calls ignore deadlines and a hung Redis holds them for ReadTimeout")
	}
	return nil
}

// Check reports, as one error, settings that keep the store from meeting
// its promises:
//   - a go-redis client without ContextTimeoutEnabled (see checkClient);
//   - a server whose maxmemory-policy may evict leasehold's keys: an
//     allkeys-* policy evicts buckets like any key, and a volatile-* policy
//     evicts them first, since every key leasehold writes has a TTL. An
//     evicted bucket comes back full, so the fleet admits a fresh burst.
//
// It returns nil for a well-built client on noeviction. The eviction check
// is a round trip (CONFIG GET on every master) and is skipped when the
// server does not allow CONFIG GET (managed services often rename it).
// hybrid.New runs Check in the background and logs what it reports.
func (s *RedisStore) Check(ctx context.Context) error {
	return errors.Join(checkClient(s.c), s.checkEviction(ctx))
}

// checkEviction is Check's eviction half.
func (s *RedisStore) checkEviction(ctx context.Context) error {
	check := func(ctx context.Context, c *redis.Client) error {
		v, err := c.ConfigGet(ctx, "maxmemory-policy").Result()
		if err != nil {
			return nil
		}
		if p := v["maxmemory-policy"]; strings.HasPrefix(p, "allkeys-") || strings.HasPrefix(p, "volatile-") {
			return errs.Errorf("remote", "%s has maxmemory-policy %s: Redis may evict buckets, which then come back full; use noeviction or a dedicated Redis", c.Options().Addr, p)
		}
		return nil
	}
	switch c := s.c.(type) {
	case *redis.Client:
		return check(ctx, c)
	case *redis.ClusterClient:
		var mu sync.Mutex
		var first error
		_ = c.ForEachMaster(ctx, func(ctx context.Context, n *redis.Client) error {
			if err := check(ctx, n); err != nil {
				mu.Lock()
				first = cmp.Or(first, err)
				mu.Unlock()
			}
			return nil
		})
		return first
	}
	return nil
}

// Client returns the client the store runs on.
func (s *RedisStore) Client() redis.UniversalClient { return s.c }

func (s *RedisStore) do(ctx context.Context, op Op, r Request) (Result, error) {
	call, err := s.args.scriptArgs(op, &r)
	if err != nil {
		return Result{}, err
	}
	v, err := s.eval(ctx, call)
	if err != nil {
		return Result{}, s.failed(call.keys[0], err)
	}
	defer call.release()
	return parseReply(call.keys[0], v)
}

// eval sends call (its keys all in one slot) as its EVALSHA command,
// through the autopipeliner when there is one, and as EVAL when the server
// has lost the script.
func (s *RedisStore) eval(ctx context.Context, call *scriptCall) (any, error) {
	cmd := call.command(ctx)
	err := s.send(ctx, cmd, call.keys[0])
	// err != nil first: HasErrorPrefix's errors.As costs an allocation
	// even on nil.
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		// EVAL caches the script again for the next EVALSHA.
		return call.script.Eval(ctx, s.c, call.keys, call.args()...).Result()
	}
	if err != nil {
		return nil, err
	}
	return cmd.Result()
}

// send sends cmd, whose first key is key, on a pooled connection or
// through the autopipeliner (see WithAutoPipeline).
func (s *RedisStore) send(ctx context.Context, cmd redis.Cmder, key string) error {
	if s.ap != nil {
		return s.ap.Submit(ctx, cmd).WaitContext(ctx)
	}
	if s.over == nil {
		return s.c.Process(ctx, cmd)
	}
	n, ap := s.over.enter(ctx, key)
	defer s.over.leave(n)
	if ap != nil {
		return ap.Submit(ctx, cmd).WaitContext(ctx)
	}
	return s.c.Process(ctx, cmd)
}

// scriptCall is one call of a script: its keys, and the EVALSHA command
// that sends them and its arguments, built once (go-redis's EvalSha would
// copy them into a command of its own and box the script's hash again).
type scriptCall struct {
	script *redis.Script
	keys   []string
	cmd    []any // "evalsha", the hash, len(keys), the keys, the arguments
	// room, when set, is the pooled bucketCall that holds keys and cmd.
	room *bucketCall
}

// release gives the call's room back for another call. Only a call whose
// command completed may release it: a command an autopipeliner still
// holds (its caller's context ended first) would be sent with another
// call's keys and arguments.
func (c *scriptCall) release() {
	if b := c.room; b != nil {
		*b = bucketCall{} // drops the keys and arguments it held
		bucketCalls.Put(b)
	}
}

// newScriptCall returns a call of script (its hash boxed as sha) on keys
// with room for n arguments, which the caller appends to cmd.
func newScriptCall(script *redis.Script, sha any, keys []string, n int) *scriptCall {
	call := &scriptCall{script: script, keys: keys}
	call.cmd = appendHead(make([]any, 0, 3+len(keys)+n), sha, keys)
	return call
}

// appendHead appends EVALSHA's name, the script's hash and the keys to cmd.
func appendHead(cmd []any, sha any, keys []string) []any {
	cmd = append(cmd, "evalsha", sha, len(keys))
	for _, k := range keys {
		cmd = append(cmd, k)
	}
	return cmd
}

// command is the call's EVALSHA command, to send as it is.
func (c *scriptCall) command(ctx context.Context) *redis.Cmd {
	cmd := redis.NewCmd(ctx, c.cmd...)
	cmd.SetFirstKeyPos(3)
	return cmd
}

// args is the script's arguments, the command's tail.
func (c *scriptCall) args() []any { return c.cmd[3+len(c.keys):] }

// The scripts' hashes, boxed once as EVALSHA's argument.
var (
	bucketSHA any = bucketScript.Hash()
	shapeSHA  any = shapeScript.Hash()
)

// failed classifies err and, when a node could not be reached, asks a
// Cluster client to reload its slot map.
func (s *RedisStore) failed(key string, err error) error {
	err = classify(key, err)
	if s.reload != nil && errors.Is(err, ErrUnavailable) && !errors.Is(err, context.Canceled) {
		s.reload()
	}
	return err
}

// Batch implements Store. Commands go out in one pipeline, which a Cluster
// client splits into one pipeline per node; any that find the script
// missing are sent again in a second pipeline as EVAL.
func (s *RedisStore) Batch(ctx context.Context, op Op, rs []Request) []Reply {
	out := make([]Reply, len(rs))
	calls := make([]*scriptCall, len(rs))
	cmds := make([]*redis.Cmd, len(rs))
	pipe := s.c.Pipeline()
	for i := range rs {
		var err error
		if calls[i], err = s.args.scriptArgs(op, &rs[i]); err != nil {
			out[i].Err = err
			continue
		}
		cmds[i] = calls[i].command(ctx)
		_ = pipe.Process(ctx, cmds[i]) // queued; its outcome is read below
	}
	if pipe.Len() > 0 {
		_, _ = pipe.Exec(ctx) // errors are read per command below
	}
	var retry redis.Pipeliner
	for i, cmd := range cmds {
		if cmd == nil {
			continue
		}
		if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
			if retry == nil {
				retry = s.c.Pipeline()
			}
			cmds[i] = calls[i].script.Eval(ctx, retry, calls[i].keys, calls[i].args()...)
		}
	}
	if retry != nil {
		_, _ = retry.Exec(ctx)
	}
	for i, cmd := range cmds {
		if cmd == nil {
			continue
		}
		v, err := cmd.Result()
		if err != nil {
			out[i].Err = s.failed(calls[i].keys[0], err)
			continue
		}
		out[i].Result, out[i].Err = parseReply(calls[i].keys[0], v)
		calls[i].release()
	}
	return out
}

// Script arguments boxed once: every store call passes them, and boxing a
// string or a number above 255 allocates.
var (
	ttlMarginArg any = TTLMargin.Milliseconds()
	opArgs           = func() (a [opUngrant + 1]any) {
		for o := range a {
			a[o] = Op(o).String()
		}
		return a
	}()
)

// arg is o's name as a script argument.
func (o Op) arg() any {
	if o >= 0 && int(o) < len(opArgs) {
		return opArgs[o]
	}
	return o.String()
}

// argCache keeps the numbers of the limit a store was last asked about
// boxed as script arguments: a limiter asks about the same few limits on
// every call, and each number above 255 was an allocation per call.
type argCache struct {
	last  atomic.Pointer[limitArgs]
	stock atomic.Pointer[stockArgs]
}

// stockArgs is a holder's name and term, and them boxed.
type stockArgs struct {
	holder string
	term   time.Duration
	boxed  [2]any
}

// holder returns s's holder and term in µs boxed: a limiter names the
// same holder and term on every call.
func (c *argCache) holder(s Stock) *[2]any {
	if l := c.stock.Load(); l != nil && l.holder == s.Holder && l.term == s.Term {
		return &l.boxed
	}
	l := &stockArgs{holder: s.Holder, term: s.Term, boxed: [2]any{s.Holder, s.Term.Microseconds()}}
	c.stock.Store(l)
	return &l.boxed
}

// limitArgs is one limit's numbers, and them boxed.
type limitArgs struct {
	m        exact.Micros
	maxDelay int64
	boxed    [4]any // rate, per, burst, max delay
}

// limit returns m's numbers and maxDelay boxed.
func (c *argCache) limit(m exact.Micros, maxDelay int64) *[4]any {
	if l := c.last.Load(); l != nil && l.m == m && l.maxDelay == maxDelay {
		return &l.boxed
	}
	l := &limitArgs{m: m, maxDelay: maxDelay, boxed: [4]any{m.Rate, m.Per, m.Burst, maxDelay}}
	c.last.Store(l)
	return &l.boxed
}

// bucketCall is a call of the bucket script and the room for its keys and
// command, in one allocation (a cold decision's store call made 4 of its
// own before go-redis's: two slices and two key strings), kept in
// bucketCalls for reuse: at 512 bytes it was a third of a cold decision's
// garbage (BenchmarkColdDecisions).
type bucketCall struct {
	scriptCall
	keyRoom [2]string
	cmdRoom [5 + 20]any // the head, 11 arguments (16 for a grant), 8 more for a debit with a mark
}

// newBucketCall returns a call of the bucket script on r's bucket and
// grants keys, its arguments to be appended to cmd.
func newBucketCall(r *Request) *bucketCall {
	call, _ := bucketCalls.Get().(*bucketCall)
	if call == nil {
		call = new(bucketCall)
	}
	call.keyRoom[0], call.keyRoom[1] = bucketKeys(r)
	call.scriptCall = scriptCall{script: bucketScript, keys: call.keyRoom[:], room: call}
	call.cmd = appendHead(call.cmdRoom[:0], bucketSHA, call.keys)
	return call
}

// bucketCalls keeps released bucketCalls (see scriptCall.release).
var bucketCalls sync.Pool

// scriptArgs validates r and returns the call of the script that keeps its
// bucket (bucketLua, or shapeLua for a shaped request) on its keys (the
// bucket's first) with the script's arguments.
func (c *argCache) scriptArgs(op Op, r *Request) (*scriptCall, error) {
	m, err := validate(op, r)
	if err != nil {
		return nil, err
	}
	if !r.shaped() {
		b := c.limit(m, int64(r.MaxDelay/time.Microsecond))
		call := newBucketCall(r)
		call.cmd = append(call.cmd, op.arg(), r.N, r.Min, b[0], b[1], b[2], r.Version,
			b[3], -maxDebt, ttlMarginArg, r.Need)
		if op == OpDebit && r.Mark.Born != 0 {
			// The grant arguments (12–16) are unused by a debit.
			call.cmd = append(call.cmd, "", 0, 0, 0, 0, r.Spent, r.Mark.Born, r.Mark.Spill)
		}
		if st := r.Stock; st.Holder != "" {
			// Arguments 13 and 16–20 are unused by a lease or return.
			h := c.holder(st)
			release := 0
			if st.Release {
				release = 1
			}
			call.cmd = append(call.cmd, h[0], release, h[1], st.maxRecords(), 0, 0, 0, 0, 0, st.Keep, st.Seq, st.Spend)
		}
		return &call.scriptCall, nil
	}
	ls, err := validateShape(op, r)
	if err != nil {
		return nil, err
	}
	var since int64
	if !r.Since.IsZero() {
		since = r.Since.UnixMicro()
	}
	call := newScriptCall(shapeScript, shapeSHA, []string{bucketKey(r)}, 10+4*len(ls))
	args := append(call.cmd, op.arg(), r.N, r.Min, r.Need, r.Version, -maxDebt, ttlMarginArg,
		int64(r.Hold/time.Microsecond), since, len(ls))
	for _, l := range ls {
		kind := "g"
		if l.window {
			kind = "w"
		}
		args = append(args, kind, l.m.Rate, l.m.Per, l.m.Burst)
	}
	call.cmd = args
	return call, nil
}

// classify wraps a Redis failure: foreign data in the key is
// ErrCorruptState, anything else (network, timeout, cluster down) is
// ErrUnavailable. Context errors stay reachable through errors.Is.
func classify(key string, err error) error {
	if redis.HasErrorPrefix(err, "LEASEHOLD_CORRUPT") {
		return errs.Errorf("remote", "key %q: %w: %w", key, ErrCorruptState, err)
	}
	if redis.HasErrorPrefix(err, "OOM") {
		return errs.Errorf("remote", "key %q: %w: %w: %w", key, ErrUnavailable, ErrUnreachable, fullError{err})
	}
	if unreachable(err) {
		return errs.Errorf("remote", "key %q: %w: %w: %w", key, ErrUnavailable, ErrUnreachable, err)
	}
	return errs.Errorf("remote", "key %q: %w: %w", key, ErrUnavailable, err)
}

// fullError is a Redis OOM reply, marked hooks.ErrFull as well.
type fullError struct{ error }

func (e fullError) Unwrap() []error { return []error{e.error, hooks.ErrFull} }

// unreachable reports errors that say the server is down, not slow: a
// refused, reset or closed connection, or a server that refuses to serve.
// A timeout is not one of them: the store may only be slow.
func unreachable(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return false
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, redis.ErrClosed) {
		return true
	}
	for _, prefix := range []string{"LOADING", "CLUSTERDOWN", "MASTERDOWN", "OOM", "READONLY", "TRYAGAIN"} {
		if redis.HasErrorPrefix(err, prefix) {
			return true
		}
	}
	var ne net.Error
	return errors.As(err, &ne) && !ne.Timeout()
}

// parseReply reads the script's reply with checked conversions; every
// script reply goes through it.
func parseReply(key string, v any) (Result, error) {
	vals, ok := v.([]any)
	if !ok || len(vals) < 9 || len(vals) > 14 {
		return Result{}, errs.Errorf("remote", "bucket %q: %w: reply %T of unexpected shape", key, ErrCorruptState, v)
	}
	var n [14]int64
	for i, x := range vals {
		switch x := x.(type) {
		case int64:
			n[i] = x
		case string: // RESP3 proxies may hand numbers back as strings
			p, err := strconv.ParseInt(x, 10, 64)
			if err != nil {
				return Result{}, errs.Errorf("remote", "bucket %q: %w: field %d: %w", key, ErrCorruptState, i, err)
			}
			n[i] = p
		default:
			return Result{}, errs.Errorf("remote", "bucket %q: %w: field %d is %T", key, ErrCorruptState, i, x)
		}
	}
	if n[0] < 0 || n[1] < 0 || n[2] < 0 || n[3] < 0 || n[4] < 0 || n[6] < 0 || n[9] < 0 || n[9] >= maxLimits || n[10] < 0 || n[11] < 0 || n[12] < 0 {
		return Result{}, errs.Errorf("remote", "bucket %q: %w: negative field in %v", key, ErrCorruptState, n)
	}
	return Result{
		Granted:    n[0],
		Delay:      time.Duration(n[1]) * time.Microsecond,
		Remaining:  n[2],
		RetryAfter: time.Duration(n[3]) * time.Microsecond,
		ResetAfter: time.Duration(n[4]) * time.Microsecond,
		Now:        time.UnixMicro(n[5]),
		Version:    uint64(n[6]),
		Stale:      n[7] == 1,
		Created:    n[8] == 1,
		Binding:    int(n[9]),
		Holders:    int(n[10]),
		Mark:       SpillMark{Born: n[11], Spill: n[12]},
		Held:       n[13] == 1,
	}, nil
}

// IsUnavailable reports whether err means the store could not answer, as
// opposed to bad input or corrupt data.
func IsUnavailable(err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, context.DeadlineExceeded)
}
