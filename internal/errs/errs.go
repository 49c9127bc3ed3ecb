// Package errs builds leasehold's error messages so that each carries one
// package prefix, whatever the wrapping depth: "hybrid: allow 11 on "k",
// burst 10: n exceeds burst", not "hybrid: ...: local: n exceeds burst".
// Sentinels keep their prefix when printed alone; errors.Is and errors.As
// see through every layer.
package errs

import (
	"errors"
	"fmt"
	"strings"
)

// Packages are the prefixes a message of leasehold's may start with.
var Packages = []string{"local", "remote", "tiered", "hybrid", "breaker", "reconcile", "httplimit", "clock", "grpclimit"}

// New returns a sentinel: pkg: text.
func New(pkg, text string) error { return &prefixed{pkg: pkg, err: errors.New(text)} }

// Errorf is fmt.Errorf with pkg's prefix in front and none of its error
// arguments' prefixes inside.
func Errorf(pkg, format string, args ...any) error {
	for i, a := range args {
		if e, ok := a.(error); ok {
			args[i] = bare{e}
		}
	}
	return &prefixed{pkg: pkg, err: fmt.Errorf(format, args...)}
}

// Bare returns err's message without its package prefix.
func Bare(err error) string { return Strip(err.Error()) }

// Strip removes one leading package prefix from msg.
func Strip(msg string) string {
	for _, p := range Packages {
		if rest, ok := strings.CutPrefix(msg, p+": "); ok {
			return rest
		}
	}
	return msg
}

type prefixed struct {
	pkg string
	err error
}

func (p *prefixed) Error() string { return p.pkg + ": " + p.err.Error() }
func (p *prefixed) Unwrap() error { return p.err }

// bare is an error argument of Errorf: its message without its prefix.
type bare struct{ err error }

func (b bare) Error() string { return Bare(b.err) }
func (b bare) Unwrap() error { return b.err }
