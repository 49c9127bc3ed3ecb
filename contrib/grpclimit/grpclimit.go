// Package grpclimit is gRPC server interceptors over a hybrid.Limiter: each
// call (or stream) costs one token of the key its KeyFunc names (WithCost
// sets another cost, WithActualCost settles it after the call); a rejected
// call fails with codes.ResourceExhausted and a google.rpc.RetryInfo detail
// saying when to retry, which RetryDelay reads back on the client. A store
// outage never fails calls: the limiter decides by its outage mode.
//
// It is its own module, so that users of hybrid alone never download gRPC.
package grpclimit

import (
	"context"
	"errors"
	"net"
	"time"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/inflight"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// KeyFunc names the bucket a call is charged to; fullMethod is the call's
// "/package.Service/Method". An error fails the call with
// codes.InvalidArgument, without the error's text.
type KeyFunc func(ctx context.Context, fullMethod string) (string, error)

// ByMetadata charges the first value of the incoming metadata key md (for
// example "x-tenant"); a call without it fails.
func ByMetadata(md string) KeyFunc {
	return func(ctx context.Context, _ string) (string, error) {
		if vs := metadata.ValueFromIncomingContext(ctx, md); len(vs) > 0 && vs[0] != "" {
			return vs[0], nil
		}
		return "", errors.New("grpclimit: missing metadata " + md)
	}
}

// ByPeerIP charges the caller's IP address as the connection shows it.
func ByPeerIP(ctx context.Context, _ string) (string, error) {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return "", errors.New("grpclimit: no peer")
	}
	host, _, err := net.SplitHostPort(p.Addr.String())
	if err != nil {
		return p.Addr.String(), nil // not host:port (a unix socket): the whole address
	}
	return host, nil
}

// Option configures the interceptors.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	inflight *inflight.Limiter
	cost     func(ctx context.Context, fullMethod string) int64
	actual   func(ctx context.Context, fullMethod string, err error) int64
}

// WithCost charges cost(ctx, fullMethod) tokens for a call instead of one.
// A cost above the limit's Burst can never be admitted: such a call fails
// with codes.InvalidArgument.
func WithCost(cost func(ctx context.Context, fullMethod string) int64) Option {
	return optionFunc(func(c *config) { c.cost = cost })
}

// WithActualCost settles each admitted call's cost once its handler has
// returned (hybrid.Limiter.ChargeN, Charge.Settle): WithCost's cost is the
// estimate charged up front, actual(ctx, fullMethod, err) the cost the
// call really had, err being the handler's. What the estimate did not use
// goes back; what it lacked is charged, as debt the limit's later refills
// pay. A negative actual keeps the estimate. The handler may also settle
// the charge itself with the cost it measured (a stream's tokens, once
// sent): hybrid.ChargeFromContext(ctx).Settle(n); then actual is not
// called.
func WithActualCost(actual func(ctx context.Context, fullMethod string, err error) int64) Option {
	return optionFunc(func(c *config) { c.actual = actual })
}

// WithInFlight also caps the key's calls in flight across the fleet with
// sem: a call that finds every slot taken fails with
// codes.ResourceExhausted (and a RetryInfo of 1 s); its slot is released
// when the handler returns (for a stream, when the stream ends). The cap
// is checked before the rate limit, so a call it refuses costs no token.
func WithInFlight(sem *inflight.Limiter) Option {
	return optionFunc(func(c *config) { c.inflight = sem })
}

func newConfig(opts []Option) config {
	c := config{cost: func(context.Context, string) int64 { return 1 }}
	for _, o := range opts {
		o.apply(&c)
	}
	return c
}

// UnaryServerInterceptor limits unary calls with lim, by key.
func UnaryServerInterceptor(lim *hybrid.Limiter, key KeyFunc, opts ...Option) grpc.UnaryServerInterceptor {
	cfg := newConfig(opts)
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		release, err := cfg.enter(ctx, key, info.FullMethod)
		if err != nil {
			return nil, err
		}
		defer release()
		ch, err := admit(ctx, lim, key, info.FullMethod, &cfg)
		if err != nil {
			return nil, err
		}
		if ch == nil {
			return handler(ctx, req)
		}
		resp, err := handler(hybrid.ContextWithCharge(ctx, ch), req)
		cfg.settle(ctx, ch, info.FullMethod, err)
		return resp, err
	}
}

// StreamServerInterceptor limits the opening of streams with lim, by key:
// a stream costs one token (or WithCost's), whatever it carries, unless
// WithActualCost settles it.
func StreamServerInterceptor(lim *hybrid.Limiter, key KeyFunc, opts ...Option) grpc.StreamServerInterceptor {
	cfg := newConfig(opts)
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		release, err := cfg.enter(ss.Context(), key, info.FullMethod)
		if err != nil {
			return err
		}
		defer release()
		ch, err := admit(ss.Context(), lim, key, info.FullMethod, &cfg)
		if err != nil {
			return err
		}
		if ch == nil {
			return handler(srv, ss)
		}
		err = handler(srv, chargedStream{ss, hybrid.ContextWithCharge(ss.Context(), ch)})
		cfg.settle(ss.Context(), ch, info.FullMethod, err)
		return err
	}
}

// enter takes a slot of the call's key when WithInFlight caps calls in
// flight, and returns what gives it back.
func (c *config) enter(ctx context.Context, key KeyFunc, method string) (release func(), err error) {
	if c.inflight == nil {
		return func() {}, nil
	}
	k, err := key(ctx, method)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, "rate limit: cannot tell who is calling")
	}
	if !c.inflight.TryAcquire(k, 1) {
		return nil, exhausted("too many calls in flight", time.Second)
	}
	return func() { c.inflight.Release(k, 1) }, nil
}

// exhausted is a ResourceExhausted error that says when to retry.
func exhausted(msg string, after time.Duration) error {
	st, err := status.New(codes.ResourceExhausted, msg).WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(after)})
	if err != nil {
		return status.Error(codes.ResourceExhausted, msg)
	}
	return st.Err()
}

// chargedStream is a stream whose context carries its Charge.
type chargedStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s chargedStream) Context() context.Context { return s.ctx }

// settle settles ch after its handler returned err, unless the handler
// settled it.
func (c *config) settle(ctx context.Context, ch *hybrid.Charge, method string, err error) {
	if ch.Settled() {
		return
	}
	if n := c.actual(ctx, method, err); n >= 0 {
		_ = ch.Settle(n) // only ErrClosed is left: a limiter shutting down charges nothing
	}
}

// admit decides one call; a nil error lets it through, with its Charge
// when its cost is settled afterwards (WithActualCost).
func admit(ctx context.Context, lim *hybrid.Limiter, key KeyFunc, method string, cfg *config) (*hybrid.Charge, error) {
	k, err := key(ctx, method)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, "rate limit: cannot tell who is calling")
	}
	var d hybrid.Decision
	var ch *hybrid.Charge
	if cfg.actual != nil {
		if ch, err = lim.ChargeN(ctx, k, cfg.cost(ctx, method)); ch != nil {
			d = ch.Decision
		}
	} else {
		d, err = lim.AllowN(ctx, k, cfg.cost(ctx, method))
	}
	switch {
	case errors.Is(err, hybrid.ErrInvalidKey):
		return nil, status.Error(codes.InvalidArgument, "rate limit: invalid key")
	case errors.Is(err, hybrid.ErrExceedsBurst), errors.Is(err, hybrid.ErrInvalidN):
		return nil, status.Error(codes.InvalidArgument, "rate limit: the call costs more than the limit ever allows")
	case err != nil:
		return nil, status.Error(codes.Unavailable, "rate limit: unavailable")
	case d.Allowed:
		return ch, nil
	}
	return nil, exhausted("rate limit exceeded", d.RetryAfter)
}

// RetryDelay reads, on the client, the retry delay a rejected call carries:
// ok is false for any other error.
func RetryDelay(err error) (time.Duration, bool) {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.ResourceExhausted {
		return 0, false
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			return ri.GetRetryDelay().AsDuration(), true
		}
	}
	return 0, false
}
