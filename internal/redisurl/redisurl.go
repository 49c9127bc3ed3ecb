// Package redisurl turns a Redis URL into a go-redis client the way
// leasehold's commands need it, through go-redis's own URL parsing:
// redis:// and rediss:// (TLS), user and password (AUTH), a database,
// go-redis options as query parameters, and more nodes as addr=host:port.
// A master_name parameter means Sentinel (FailoverClient); cluster=true,
// or the caller's cluster flag, means Redis Cluster. Every client has
// ContextTimeoutEnabled, so deadlines reach calls in flight.
package redisurl

import (
	"errors"
	"fmt"
	"net/url"
	"strings"

	"github.com/redis/go-redis/v9"
)

// EnvVar is the environment variable commands read a URL from when no
// flag names one.
const EnvVar = "LEASEHOLD_REDIS_URL"

// ErrBadURL reports a URL go-redis cannot use.
var ErrBadURL = errors.New("bad Redis URL")

// Kind is the sort of deployment a URL names.
type Kind int

const (
	Standalone Kind = iota
	Cluster
	Sentinel
)

func (k Kind) String() string { return [...]string{"standalone", "cluster", "sentinel"}[k] }

// FromAddr is the URL of a plain host:port (or comma-separated
// host:port list for a cluster), for the commands' older -addr flag.
func FromAddr(addr string) string {
	hosts := strings.Split(addr, ",")
	u := "redis://" + hosts[0]
	for i, h := range hosts[1:] {
		sep := "&"
		if i == 0 {
			sep = "?"
		}
		u += sep + "addr=" + url.QueryEscape(h)
	}
	return u
}

// Settings are what the caller decides beside the URL.
type Settings struct {
	// Cluster asks for a cluster client whatever the URL says.
	Cluster bool
	// OneShot is for a command that makes a few calls and exits: one
	// dial and one retry per call (unless the URL sets max_retries), so an
	// unreachable server is reported at once rather than after go-redis's
	// dial retries and backoff.
	OneShot bool
}

// Dial returns a client of raw, a cluster client when set.Cluster or the
// URL says cluster=true, a Sentinel one when it names master_name. It
// reports the kind it chose. Passwords never appear in its errors.
func Dial(raw string, set Settings) (redis.UniversalClient, Kind, error) {
	cluster := set.Cluster
	u, err := url.Parse(raw)
	if err != nil {
		return nil, 0, fmt.Errorf("%w: %v", ErrBadURL, redact(err.Error(), raw))
	}
	q := u.Query()
	if v := q.Get("cluster"); v != "" {
		cluster = cluster || v == "true" || v == "1"
		q.Del("cluster")
		u.RawQuery = q.Encode()
	}
	oneTry := set.OneShot && !q.Has("max_retries")
	s := u.String()
	switch {
	case q.Has("master_name"):
		o, err := redis.ParseFailoverURL(s)
		if err != nil {
			return nil, 0, fmt.Errorf("%w: %v", ErrBadURL, redact(err.Error(), raw))
		}
		o.ContextTimeoutEnabled = true
		if oneTry {
			o.MaxRetries, o.DialerRetries = 1, 1
		}
		return redis.NewFailoverClient(o), Sentinel, nil
	case cluster:
		o, err := redis.ParseClusterURL(s)
		if err != nil {
			return nil, 0, fmt.Errorf("%w: %v", ErrBadURL, redact(err.Error(), raw))
		}
		o.ContextTimeoutEnabled = true
		if oneTry {
			o.MaxRetries, o.DialerRetries = 1, 1
		}
		return redis.NewClusterClient(o), Cluster, nil
	}
	o, err := redis.ParseURL(s)
	if err != nil {
		return nil, 0, fmt.Errorf("%w: %v", ErrBadURL, redact(err.Error(), raw))
	}
	o.ContextTimeoutEnabled = true
	if oneTry {
		o.MaxRetries, o.DialerRetries = 1, 1
	}
	return redis.NewClient(o), Standalone, nil
}

// Redacted is raw without its password, for messages.
func Redacted(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}

// redact removes raw's password from msg.
func redact(msg, raw string) string {
	if u, err := url.Parse(raw); err == nil && u.User != nil {
		if p, ok := u.User.Password(); ok && p != "" {
			msg = strings.ReplaceAll(msg, p, "xxxxx")
		}
	}
	return msg
}
