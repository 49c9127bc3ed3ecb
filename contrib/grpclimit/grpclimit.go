// Package grpclimit is gRPC server interceptors over a hybrid.Limiter: each
// call (or stream) costs one token of the key its KeyFunc names; a rejected
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

// UnaryServerInterceptor limits unary calls with lim, by key.
func UnaryServerInterceptor(lim *hybrid.Limiter, key KeyFunc) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if err := admit(ctx, lim, key, info.FullMethod); err != nil {
			return nil, err
		}
		return handler(ctx, req)
	}
}

// StreamServerInterceptor limits the opening of streams with lim, by key:
// a stream costs one token, whatever it carries.
func StreamServerInterceptor(lim *hybrid.Limiter, key KeyFunc) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if err := admit(ss.Context(), lim, key, info.FullMethod); err != nil {
			return err
		}
		return handler(srv, ss)
	}
}

// admit decides one call; nil lets it through.
func admit(ctx context.Context, lim *hybrid.Limiter, key KeyFunc, method string) error {
	k, err := key(ctx, method)
	if err != nil {
		return status.Error(codes.InvalidArgument, "rate limit: cannot tell who is calling")
	}
	d, err := lim.AllowN(ctx, k, 1)
	switch {
	case errors.Is(err, hybrid.ErrInvalidKey):
		return status.Error(codes.InvalidArgument, "rate limit: invalid key")
	case err != nil:
		return status.Error(codes.Unavailable, "rate limit: unavailable")
	case d.Allowed:
		return nil
	}
	st, derr := status.New(codes.ResourceExhausted, "rate limit exceeded").
		WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(d.RetryAfter)})
	if derr != nil {
		return status.Error(codes.ResourceExhausted, "rate limit exceeded")
	}
	return st.Err()
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
