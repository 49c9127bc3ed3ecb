// Package storetest holds store wrappers for leasehold's tests and demo.
package storetest

import (
	"context"
	"errors"
	"sync/atomic"

	"github.com/leasehold/leasehold/remote"
)

// ErrCut is what a Cut store answers while cut off: unavailable and
// unreachable, as a dead or partitioned Redis is.
var ErrCut = errors.Join(remote.ErrUnavailable, remote.ErrUnreachable, errors.New("storetest: store cut off"))

// Cut is a remote.Store that fails every bucket call with ErrCut while
// Down is set: a network partition between one process and its store.
type Cut struct {
	remote.Store
	Down atomic.Bool
}

// Lease implements remote.Store.
func (c *Cut) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	if c.Down.Load() {
		return remote.Result{}, ErrCut
	}
	return c.Store.Lease(ctx, r)
}

// Return implements remote.Store.
func (c *Cut) Return(ctx context.Context, r remote.Request) (remote.Result, error) {
	if c.Down.Load() {
		return remote.Result{}, ErrCut
	}
	return c.Store.Return(ctx, r)
}

// Debit implements remote.Store.
func (c *Cut) Debit(ctx context.Context, r remote.Request) (remote.Result, error) {
	if c.Down.Load() {
		return remote.Result{}, ErrCut
	}
	return c.Store.Debit(ctx, r)
}

// Batch implements remote.Store.
func (c *Cut) Batch(ctx context.Context, op remote.Op, rs []remote.Request) []remote.Reply {
	if c.Down.Load() {
		return remote.FailedReplies(len(rs), ErrCut)
	}
	return c.Store.Batch(ctx, op, rs)
}

// Grant implements remote.Granter when the wrapped store does.
func (c *Cut) Grant(ctx context.Context, r remote.GrantRequest) (remote.Grant, error) {
	g, ok := c.Store.(remote.Granter)
	switch {
	case !ok:
		return remote.Grant{}, remote.ErrNoGrants
	case c.Down.Load():
		return remote.Grant{}, ErrCut
	}
	return g.Grant(ctx, r)
}

// Ungrant implements remote.Granter when the wrapped store does.
func (c *Cut) Ungrant(ctx context.Context, r remote.GrantRequest, unspent int64) (remote.Result, error) {
	g, ok := c.Store.(remote.Granter)
	switch {
	case !ok:
		return remote.Result{}, remote.ErrNoGrants
	case c.Down.Load():
		return remote.Result{}, ErrCut
	}
	return g.Ungrant(ctx, r, unspent)
}
