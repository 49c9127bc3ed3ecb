package remote

import (
	"context"
	"fmt"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/keys"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/leasehold/leasehold/local"
)

// Bucket is what a bucket holds, as Peek reads it.
type Bucket struct {
	// Exists is false when the key is absent: the bucket is full.
	Exists bool
	// Level is the tokens in the bucket now (negative while future-dated
	// grants or outage debt are out).
	Level int64
	// Limit and Version are what the bucket was last written under.
	Limit   local.Limit
	Version uint64
	// NextToken is how long until the level rises by one (0 when full);
	// ResetAfter how long until it is full.
	NextToken, ResetAfter time.Duration
	// TTL is how long the key lives without another write.
	TTL time.Duration
}

// Peek reads the bucket of key under policy without changing it, at the
// store's current time: for operators (cmd/leasehold), not for deciding.
func (s *RedisStore) Peek(ctx context.Context, prefix, policy, key string) (Bucket, error) {
	if err := validateKey(prefix, policy, key); err != nil {
		return Bucket{}, err
	}
	bk := keys.Bucket(prefix, policy, "", key)
	v, err := peekScript.Run(ctx, s.c, []string{bk}).Slice()
	if err != nil {
		return Bucket{}, s.failed(bk, err)
	}
	if len(v) != 4 {
		return Bucket{}, errs.Errorf("remote", "bucket %q: %w: peek reply of %d fields", bk, ErrCorruptState, len(v))
	}
	raw, _ := v[0].(string)
	sec, err1 := toInt(v[1])
	usec, err2 := toInt(v[2])
	pttl, err3 := toInt(v[3])
	if err1 != nil || err2 != nil || err3 != nil {
		return Bucket{}, errs.Errorf("remote", "bucket %q: %w: peek reply %v", bk, ErrCorruptState, v)
	}
	if raw == "" {
		return Bucket{}, nil
	}
	if strings.HasPrefix(raw, "S ") {
		return Bucket{}, errs.Errorf("remote", "bucket %q holds a sliding window or several limits, which Peek does not read: %q", bk, raw)
	}
	st, err := parseState(raw)
	if err != nil {
		return Bucket{}, errs.Errorf("remote", "bucket %q: %w: %w", bk, ErrCorruptState, err)
	}
	st.refill(micros(sec*1_000_000 + usec))
	b := Bucket{Exists: true, Level: st.level, Version: st.version, TTL: time.Duration(max(pttl, 0)) * time.Millisecond,
		Limit:      readable(st.rate, st.per, st.burst),
		ResetAfter: time.Duration(st.waitFor(st.level, st.burst)) * time.Microsecond}
	if st.level < st.burst {
		b.NextToken = time.Duration(st.waitFor(st.level, st.level+1)) * time.Microsecond
	}
	return b, nil
}

func toInt(x any) (int64, error) {
	switch x := x.(type) {
	case int64:
		return x, nil
	case string:
		return strconv.ParseInt(x, 10, 64)
	}
	return 0, fmt.Errorf("%T is not a number", x)
}

// parseState reads the script's state string (see bucketLua).
func parseState(raw string) (state, error) {
	var st state
	var version int64
	n, err := fmt.Sscanf(raw, "%d %d %d %d %d %d %d", &st.level, &st.carry, &st.last, &version, &st.burst, &st.rate, &st.per)
	if err != nil || n != 7 || st.rate < 1 || st.per < 1 || st.burst < 1 || st.carry < 0 || st.carry >= st.per || version < 0 {
		return state{}, fmt.Errorf("state %q is not leasehold's", raw)
	}
	st.version = uint64(version)
	var born int64
	if n, _ := fmt.Sscanf(raw, "%d %d %d %d %d %d %d %d %d %d", new(int64), new(int64), new(int64), new(int64), new(int64),
		new(int64), new(int64), &born, &st.spill, &st.owed); n == 10 {
		st.born = micros(born)
	}
	return st, nil
}

// Members returns the live members of a policy's fleet set with the time
// since each last heartbeat, as the store sees it.
func (s *RedisStore) Members(ctx context.Context, prefix, policy string) (map[string]time.Duration, error) {
	if err := keys.ValidateNames(prefix, policy); err != nil {
		return nil, err
	}
	key := keys.Fleet(prefix, policy)
	zs, err := s.c.ZRangeWithScores(ctx, key, 0, -1).Result()
	if err != nil {
		return nil, s.failed(key, err)
	}
	now, err := s.c.Time(ctx).Result()
	if err != nil {
		return nil, s.failed(key, err)
	}
	out := make(map[string]time.Duration, len(zs))
	for _, z := range zs {
		m, _ := z.Member.(string)
		out[m] = now.Sub(time.UnixMilli(int64(z.Score)))
	}
	return out, nil
}

// readable is the limit of rate tokens per per µs as a policy would name
// it: per the shortest of a second, a minute, an hour or a day that is at
// least per and holds a whole number of tokens (a bucket keeps its limit
// in lowest terms: 5/1s is stored as 1 per 200 ms); as stored otherwise.
func readable(rate, per, burst int64) local.Limit {
	for _, p := range []time.Duration{time.Second, time.Minute, time.Hour, 24 * time.Hour} {
		if us := p.Microseconds(); us >= per && us%per == 0 && rate <= math.MaxInt64/(us/per) {
			return local.Limit{Rate: rate * (us / per), Period: p, Burst: burst}
		}
	}
	return local.Limit{Rate: rate, Period: time.Duration(per) * time.Microsecond, Burst: burst}
}
