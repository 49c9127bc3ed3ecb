package redistest

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// Sentinels is a master, its replicas and the sentinels that watch them,
// all on loopback, stopped when the test ends.
type Sentinels struct {
	Name      string // the master's name for the sentinels
	Master    *Server
	Replicas  []*Server
	Sentinels []*Server // each's Addr is a sentinel's address
}

// Addrs returns the sentinels' addresses.
func (s *Sentinels) Addrs() []string {
	out := make([]string, len(s.Sentinels))
	for i, x := range s.Sentinels {
		out[i] = x.Addr
	}
	return out
}

// NewSentinels starts a master named name with replicas replicas and
// sentinels sentinels (quorum: a majority), which detect a dead master
// after downAfter and fail over.
func NewSentinels(t testing.TB, name string, replicas, sentinels int, downAfter time.Duration) *Sentinels {
	t.Helper()
	s := &Sentinels{Name: name, Master: NewServer(t)}
	host, port, _ := net.SplitHostPort(s.Master.Addr)
	for range replicas {
		s.Replicas = append(s.Replicas, NewServer(t, "--replicaof", host, port))
	}
	quorum := sentinels/2 + 1
	for range sentinels {
		s.Sentinels = append(s.Sentinels, newSentinel(t, name, host, port, quorum, downAfter))
	}
	return s
}

// newSentinel starts one sentinel watching host:port as name.
func newSentinel(t testing.TB, name, host, port string, quorum int, downAfter time.Duration) *Server {
	t.Helper()
	need(t)
	dir, err := os.MkdirTemp("", "leasehold-sentinel-")
	if err != nil {
		t.Fatal(err)
	}
	p, err := freePort(false)
	if err != nil {
		t.Fatal(err)
	}
	conf := filepath.Join(dir, "sentinel.conf")
	body := fmt.Sprintf("port %d\nbind 127.0.0.1\nprotected-mode no\ndir %s\nlogfile %s\n"+
		"sentinel monitor %s %s %s %d\nsentinel down-after-milliseconds %s %d\n"+
		"sentinel failover-timeout %s %d\nsentinel parallel-syncs %s 1\n",
		p, dir, filepath.Join(dir, "redis.log"), name, host, port, quorum, name, downAfter.Milliseconds(),
		name, max(3*downAfter, time.Second).Milliseconds(), name)
	if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	s := &Server{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(p)), dir: dir, args: []string{conf, "--sentinel"}}
	s.mu.Lock()
	err = s.launchLocked()
	s.mu.Unlock()
	if err != nil {
		_ = os.RemoveAll(dir)
		t.Fatalf("redistest: sentinel: %v", err)
	}
	mu.Lock()
	started = append(started, s)
	mu.Unlock()
	t.Cleanup(func() { s.stop(); _ = os.RemoveAll(dir) })
	return s
}
