// Package redistest starts real redis-server processes for tests: a shared
// standalone server, a shared 3-master/3-replica cluster, and private
// servers a test may pause, kill and restart. Servers listen on free
// loopback ports, keep their files in a temp dir, and are stopped when the
// test binary ends (Main), or by the kernel if it dies first.
//
// Without redis-server on PATH the helpers skip the test with a message,
// unless LEASEHOLD_REQUIRE_REDIS=1, where they fail it.
package redistest

import (
	"context"
	"errors"
	"fmt"
	"github.com/alicebob/miniredis/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RequireEnv is the environment variable that turns a missing redis-server
// into a test failure.
const RequireEnv = "LEASEHOLD_REQUIRE_REDIS"

var (
	mu         sync.Mutex
	started    []*Server
	sharedOnce sync.Once
	shared     *Server
	sharedErr  error
	clusOnce   sync.Once
	clus       *Cluster
	clusErr    error
)

// Main runs the tests of a package and then stops every server it started.
// Call it from TestMain: func TestMain(m *testing.M) { redistest.Main(m) }.
func Main(m *testing.M) {
	code := m.Run()
	StopAll()
	os.Exit(code)
}

// StopAll stops every server started by this binary.
func StopAll() {
	mu.Lock()
	all := started
	started = nil
	mu.Unlock()
	for _, s := range all {
		s.stop()
		_ = os.RemoveAll(s.dir)
	}
}

// Available reports whether redis-server and redis-cli are on PATH.
func Available() bool {
	_, e1 := exec.LookPath("redis-server")
	_, e2 := exec.LookPath("redis-cli")
	return e1 == nil && e2 == nil
}

func need(t testing.TB) {
	t.Helper()
	if Available() {
		return
	}
	msg := "redis-server/redis-cli not on PATH: real-Redis tests need them (`make test` installs them; Debian: apt-get install -y redis-server)"
	if os.Getenv(RequireEnv) == "1" {
		t.Fatalf("%s; %s=1 makes this a failure", msg, RequireEnv)
	}
	t.Skip(msg)
}

// Server is one redis-server process.
type Server struct {
	Addr  string
	dir   string
	args  []string
	mu    sync.Mutex
	cmd   *exec.Cmd
	pause bool
}

// Standalone returns the binary's shared standalone server, starting it on
// first use. Tests share it, so each should use its own keys (for instance
// a policy named after t.Name()).
func Standalone(t testing.TB) *Server {
	t.Helper()
	need(t)
	sharedOnce.Do(func() { shared, sharedErr = start(nil) })
	if sharedErr != nil {
		t.Fatalf("redistest: standalone: %v", sharedErr)
	}
	return shared
}

// StandaloneAddr returns the address of the binary's shared standalone
// server, starting it on first use, for code without a testing.TB (a
// runnable Example). It fails when redis-server is not installed; the
// server is stopped by Main.
func StandaloneAddr() (string, error) {
	if !Available() {
		return "", errors.New("redistest: redis-server not on PATH")
	}
	sharedOnce.Do(func() { shared, sharedErr = start(nil) })
	if sharedErr != nil {
		return "", sharedErr
	}
	return shared.Addr, nil
}

// ExampleAddr is where a runnable Example finds Redis: the shared real
// server when redis-server is installed (make test always has it), else
// an in-memory miniredis, so that `go test` without Redis still runs the
// examples. A service uses its own Redis's address instead.
func ExampleAddr() string {
	if addr, err := StandaloneAddr(); err == nil {
		return addr
	}
	mr := miniredis.NewMiniRedis()
	if err := mr.Start(); err != nil {
		panic(err)
	}
	return mr.Addr()
}

// NewServer starts a private server the test may pause, kill or restart,
// with extra redis-server arguments (such as "--maxmemory", "4mb"); it is
// stopped when the test ends.
func NewServer(t testing.TB, extra ...string) *Server {
	t.Helper()
	need(t)
	s, err := start(extra)
	if err != nil {
		t.Fatalf("redistest: %v", err)
	}
	t.Cleanup(func() { s.stop(); _ = os.RemoveAll(s.dir) })
	return s
}

// Client returns a new client of s, closed when the test ends.
func (s *Server) Client(t testing.TB, opts ...func(*redis.Options)) *redis.Client {
	t.Helper()
	// Deadlines must reach in-flight reads, as leasehold's docs require.
	o := &redis.Options{Addr: s.Addr, ContextTimeoutEnabled: true}
	for _, f := range opts {
		f(o)
	}
	c := redis.NewClient(o)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Pause stops the process with SIGSTOP: connections hang.
func (s *Server) Pause() error { return s.signal(syscall.SIGSTOP, true) }

// Resume continues a paused process with SIGCONT.
func (s *Server) Resume() error { return s.signal(syscall.SIGCONT, false) }

// Kill kills the process: connections are refused until Restart.
func (s *Server) Kill() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return nil
	}
	if s.pause {
		_ = s.cmd.Process.Signal(syscall.SIGCONT)
		s.pause = false
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
	return nil
}

// Restart starts the process again on the same port, with an empty data
// set (persistence is off).
func (s *Server) Restart() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		return errors.New("redistest: restart of a running server")
	}
	return s.launchLocked()
}

func (s *Server) signal(sig syscall.Signal, pause bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return errors.New("redistest: server not running")
	}
	s.pause = pause
	return s.cmd.Process.Signal(sig)
}

func (s *Server) stop() {
	_ = s.Kill()
}

// start launches a redis-server on a free port. A port found free can be
// taken before the server binds it, and a cluster node also binds its
// port + 10 000 for the cluster bus (taken by another process in one
// make test run): it tries again on another port then.
func start(extra []string) (*Server, error) {
	cluster := slices.Contains(extra, "--cluster-enabled")
	var err error
	for range 5 {
		var s *Server
		if s, err = startOn(extra, cluster); err == nil || !strings.Contains(err.Error(), "Address already in use") {
			return s, err
		}
	}
	return nil, err
}

func startOn(extra []string, cluster bool) (*Server, error) {
	dir, err := os.MkdirTemp("", "leasehold-redis-")
	if err != nil {
		return nil, err
	}
	port, err := freePort(cluster)
	if err != nil {
		return nil, err
	}
	s := &Server{Addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), dir: dir}
	s.args = append([]string{
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--dir", dir,
		"--save", "", "--appendonly", "no", "--protected-mode", "no",
		"--daemonize", "no", "--logfile", filepath.Join(dir, "redis.log"),
	}, extra...)
	s.mu.Lock()
	err = s.launchLocked()
	s.mu.Unlock()
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	mu.Lock()
	started = append(started, s)
	mu.Unlock()
	return s, nil
}

func (s *Server) launchLocked() error {
	cmd := exec.Command("redis-server", s.args...)
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start redis-server: %w", err)
	}
	s.cmd = cmd
	s.pause = false
	if err := waitPing(s.Addr, 10*time.Second); err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		s.cmd = nil
		log, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
		return fmt.Errorf("redis-server on %s: %w\n%s", s.Addr, err, log)
	}
	return nil
}

func waitPing(addr string, timeout time.Duration) error {
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer c.Close()
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond) // polling a process we just started
	}
}

// freePort returns a port free on loopback, and for a cluster node one
// whose bus port (+10 000) is free too.
func freePort(cluster bool) (int, error) {
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		if !cluster {
			l.Close()
			return port, nil
		}
		bus, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+10000)))
		l.Close()
		if err == nil {
			bus.Close()
			return port, nil
		}
	}
}

// Cluster is a Redis Cluster of 3 masters and 3 replicas on loopback.
type Cluster struct {
	Nodes []*Server
}

// SharedCluster returns the binary's shared cluster, creating it on first
// use with redis-cli --cluster create and waiting for cluster_state:ok.
func SharedCluster(t testing.TB) *Cluster {
	t.Helper()
	need(t)
	clusOnce.Do(func() { clus, clusErr = startCluster() })
	if clusErr != nil {
		t.Fatalf("redistest: cluster: %v", clusErr)
	}
	return clus
}

// Addrs returns every node's address.
func (c *Cluster) Addrs() []string {
	out := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		out[i] = n.Addr
	}
	return out
}

// Client returns a new cluster client, closed when the test ends.
func (c *Cluster) Client(t testing.TB) *redis.ClusterClient {
	t.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// NewCluster starts a private 3-master/3-replica cluster that the test may
// kill nodes of, with the given cluster-node-timeout; it is stopped when
// the test ends.
func NewCluster(t testing.TB, nodeTimeout time.Duration) *Cluster {
	t.Helper()
	need(t)
	c, err := startClusterWith(nodeTimeout)
	if err != nil {
		t.Fatalf("redistest: cluster: %v", err)
	}
	t.Cleanup(func() {
		for _, n := range c.Nodes {
			n.stop()
			_ = os.RemoveAll(n.dir)
		}
	})
	return c
}

// MasterOf returns the node that serves key's slot now, as the cluster
// itself reports it (asked through any live node).
func (c *Cluster) MasterOf(ctx context.Context, key string) (*Server, error) {
	for _, n := range c.Nodes {
		cl := redis.NewClient(&redis.Options{Addr: n.Addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
		slot, err := cl.ClusterKeySlot(ctx, key).Result()
		if err != nil {
			cl.Close()
			continue
		}
		shards, err := cl.ClusterShards(ctx).Result()
		cl.Close()
		if err != nil {
			continue
		}
		for _, sh := range shards {
			for _, r := range sh.Slots {
				if int64(r.Start) > slot || slot > int64(r.End) {
					continue
				}
				for _, nd := range sh.Nodes {
					if nd.Role == "master" && nd.Health == "online" {
						for _, s := range c.Nodes {
							if strings.HasSuffix(s.Addr, ":"+strconv.FormatInt(nd.Port, 10)) {
								return s, nil
							}
						}
					}
				}
			}
		}
	}
	return nil, errors.New("redistest: no live node knows the key's master")
}

// FailoverOf asks a replica of key's master to take over (CLUSTER
// FAILOVER, the graceful hand-over of a planned maintenance).
func (c *Cluster) FailoverOf(ctx context.Context, key string) error {
	master, err := c.MasterOf(ctx, key)
	if err != nil {
		return err
	}
	mc := redis.NewClient(&redis.Options{Addr: master.Addr})
	defer mc.Close()
	id, err := mc.ClusterMyID(ctx).Result()
	if err != nil {
		return err
	}
	for _, n := range c.Nodes {
		cl := redis.NewClient(&redis.Options{Addr: n.Addr})
		info, err := cl.Do(ctx, "ROLE").Slice()
		if err == nil && len(info) >= 3 && info[0] == "slave" {
			if mid, err := cl.ClusterMyID(ctx).Result(); err == nil && mid != id {
				nodes, _ := cl.ClusterNodes(ctx).Result()
				if strings.Contains(nodes, "myself,slave "+id) {
					err = cl.ClusterFailover(ctx).Err()
					cl.Close()
					return err
				}
			}
		}
		cl.Close()
	}
	return errors.New("redistest: no replica of the key's master")
}

func startCluster() (*Cluster, error) { return startClusterWith(2 * time.Second) }

func startClusterWith(nodeTimeout time.Duration) (*Cluster, error) {
	c := &Cluster{}
	for i := 0; i < 6; i++ {
		s, err := start([]string{"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", strconv.FormatInt(nodeTimeout.Milliseconds(), 10)})
		if err != nil {
			return nil, err
		}
		c.Nodes = append(c.Nodes, s)
	}
	args := append([]string{"--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", "1", "--cluster-yes")
	out, err := exec.Command("redis-cli", args...).CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("redis-cli --cluster create: %w\n%s", err, out)
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, n := range c.Nodes {
		cl := redis.NewClient(&redis.Options{Addr: n.Addr})
		for {
			info, err := cl.ClusterInfo(context.Background()).Result()
			repl, _ := cl.Info(context.Background(), "replication").Result()
			synced := strings.Contains(repl, "role:master") || strings.Contains(repl, "master_link_status:up")
			if err == nil && strings.Contains(info, "cluster_state:ok") && strings.Contains(info, "cluster_slots_ok:16384") && synced {
				break // replicas must have synced: one that never did cannot take over
			}
			if time.Now().After(deadline) {
				cl.Close()
				return nil, fmt.Errorf("node %s not ok: %v %s", n.Addr, err, info)
			}
			time.Sleep(50 * time.Millisecond) // polling cluster convergence
		}
		cl.Close()
	}
	return c, nil
}

// MainWith is Main with a check run after the tests (and after the servers
// stopped), such as goleak.Find; a check error fails the binary.
func MainWith(m *testing.M, check func() error) {
	code := m.Run()
	StopAll()
	if code == 0 && check != nil {
		if err := check(); err != nil {
			fmt.Fprintln(os.Stderr, "redistest: after tests:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// FlushScripts runs SCRIPT FLUSH on c's server, or on every master of a
// cluster, as an operator or a failover to a fresh node would.
func FlushScripts(t testing.TB, c redis.UniversalClient) {
	t.Helper()
	ctx := context.Background()
	if cc, ok := c.(*redis.ClusterClient); ok {
		if err := cc.ForEachShard(ctx, func(ctx context.Context, n *redis.Client) error {
			return n.ScriptFlush(ctx).Err()
		}); err != nil {
			t.Fatal(err)
		}
		return
	}
	if err := c.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
}
