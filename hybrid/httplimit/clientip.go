package httplimit

import (
	"github.com/leasehold/leasehold/internal/errs"
	"net"
	"net/http"
	"net/netip"
	"strings"
)

// ByClientIP charges each client IP address, taking it from the Forwarded
// (RFC 7239) or X-Forwarded-For fields only when the connection comes from
// a trusted proxy: starting from the connection's address, it walks the
// chain of proxies from the nearest and stops at the first address that is
// not in trusted. A client that is not behind a trusted proxy is charged by
// its connection address, whatever it claims in those fields. trusted are
// CIDR prefixes ("10.0.0.0/8", "::1/128"); an invalid one is an error.
func ByClientIP(trusted ...string) (KeyFunc, error) {
	var nets []netip.Prefix
	for _, t := range trusted {
		p, err := netip.ParsePrefix(t)
		if err != nil {
			return nil, errs.Errorf("httplimit", "trusted proxy %q: %w", t, err)
		}
		nets = append(nets, p.Masked())
	}
	isTrusted := func(a netip.Addr) bool {
		for _, p := range nets {
			if p.Contains(a.Unmap()) {
				return true
			}
		}
		return false
	}
	return func(r *http.Request) (string, error) {
		host, _, err := net.SplitHostPort(r.RemoteAddr)
		if err != nil {
			return "", err
		}
		addr, err := netip.ParseAddr(host)
		if err != nil {
			return "", err
		}
		if !isTrusted(addr) {
			return addr.Unmap().String(), nil
		}
		hops := forwardedFor(r)
		// Nearest proxy last: walk back while the hop is trusted.
		for i := len(hops) - 1; i >= 0; i-- {
			a, err := netip.ParseAddr(hops[i])
			if err != nil {
				return "", errs.New("httplimit", "unparsable forwarded address")
			}
			addr = a
			if !isTrusted(a) {
				break
			}
		}
		return addr.Unmap().String(), nil
	}, nil
}

// forwardedFor returns the client chain a request's proxies reported,
// farthest first: the for= values of Forwarded if present, else
// X-Forwarded-For.
func forwardedFor(r *http.Request) []string {
	var hops []string
	for _, line := range r.Header.Values("Forwarded") {
		for _, elem := range strings.Split(line, ",") {
			for _, pair := range strings.Split(elem, ";") {
				k, v, ok := strings.Cut(strings.TrimSpace(pair), "=")
				if !ok || !strings.EqualFold(k, "for") {
					continue
				}
				hops = append(hops, forwardedNode(v))
			}
		}
	}
	if len(hops) > 0 {
		return hops
	}
	for _, line := range r.Header.Values("X-Forwarded-For") {
		for _, h := range strings.Split(line, ",") {
			hops = append(hops, strings.TrimSpace(h))
		}
	}
	return hops
}

// forwardedNode strips a Forwarded node of its quotes, IPv6 brackets and
// port: `"[2001:db8::1]:4711"` → `2001:db8::1`.
func forwardedNode(v string) string {
	v = strings.Trim(v, `"`)
	if strings.HasPrefix(v, "[") {
		if end := strings.IndexByte(v, ']'); end > 0 {
			return v[1:end]
		}
	}
	if host, _, err := net.SplitHostPort(v); err == nil {
		return host
	}
	return v
}
