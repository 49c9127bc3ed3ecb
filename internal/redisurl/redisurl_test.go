package redisurl_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/redisurl"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/redis/go-redis/v9"
)

func TestMain(m *testing.M) { redistest.Main(m) }

// roundTrip writes and reads a key through c.
func roundTrip(t *testing.T, c redis.UniversalClient) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	key := "{redisurl}:" + t.Name()
	if err := c.Set(ctx, key, "v", time.Minute).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if got, err := c.Get(ctx, key).Result(); err != nil || got != "v" {
		t.Fatalf("GET = %q, %v", got, err)
	}
}

// TestDial connects to each kind of deployment by URL, as the CLI and
// the demo do, on real servers.
func TestDial(t *testing.T) {
	ctx := context.Background()
	t.Run("standalone with AUTH as a user and a database", func(t *testing.T) {
		s := redistest.NewServer(t)
		admin := s.Client(t)
		if err := admin.Do(ctx, "ACL", "SETUSER", "ops", "on", ">s3cret", "~*", "+@all").Err(); err != nil {
			t.Fatal(err)
		}
		if err := admin.ConfigSet(ctx, "requirepass", "topsecret").Err(); err != nil {
			t.Fatal(err)
		}
		c, kind, err := redisurl.Dial("redis://ops:s3cret@"+s.Addr+"/2", redisurl.Settings{})
		if err != nil || kind != redisurl.Standalone {
			t.Fatalf("Dial = %v, %v", kind, err)
		}
		defer c.Close()
		roundTrip(t, c)
		bad, _, _ := redisurl.Dial("redis://ops:wrong@"+s.Addr, redisurl.Settings{OneShot: true})
		defer bad.Close()
		if err := bad.Ping(ctx).Err(); err == nil || !strings.Contains(err.Error(), "WRONGPASS") {
			t.Fatalf("a wrong password: %v, want WRONGPASS", err)
		}
	})
	t.Run("TLS", func(t *testing.T) {
		s := redistest.NewServer(t)
		port := enableTLS(t, s)
		c, _, err := redisurl.Dial("rediss://127.0.0.1:"+port+"?skip_verify=true", redisurl.Settings{})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		roundTrip(t, c)
		plain, _, _ := redisurl.Dial("redis://127.0.0.1:"+port+"?read_timeout=300ms", redisurl.Settings{OneShot: true})
		defer plain.Close()
		if err := plain.Ping(ctx).Err(); err == nil {
			t.Fatal("a plain connection to the TLS port succeeded")
		}
	})
	t.Run("cluster", func(t *testing.T) {
		addrs := redistest.SharedCluster(t).Addrs()
		u := redisurl.FromAddr(strings.Join(addrs, ","))
		for _, tc := range []struct {
			url  string
			flag bool
		}{{u, true}, {u + "&cluster=true", false}} {
			c, kind, err := redisurl.Dial(tc.url, redisurl.Settings{Cluster: tc.flag})
			if err != nil || kind != redisurl.Cluster {
				t.Fatalf("Dial(%s) = %v, %v", tc.url, kind, err)
			}
			roundTrip(t, c)
			_ = c.Close()
		}
	})
	t.Run("sentinel", func(t *testing.T) {
		sn := redistest.NewSentinels(t, "leasehold", 1, 3, time.Second)
		u := redisurl.FromAddr(strings.Join(sn.Addrs(), ",")) + "&master_name=" + sn.Name
		c, kind, err := redisurl.Dial(u, redisurl.Settings{})
		if err != nil || kind != redisurl.Sentinel {
			t.Fatalf("Dial(%s) = %v, %v", u, kind, err)
		}
		defer c.Close()
		roundTrip(t, c)
		// The write went to the master the sentinels name.
		if got, err := sn.Master.Client(t).Get(ctx, "{redisurl}:"+t.Name()).Result(); err != nil || got != "v" {
			t.Fatalf("the master holds %q, %v; want the key written through the URL", got, err)
		}
	})
}

// TestBadURL: an unusable URL is ErrBadURL, and its message never shows
// the password.
func TestBadURL(t *testing.T) {
	for _, u := range []string{"redis://ops:hunter2@host:6379?no_such_option=1", "http://ops:hunter2@host", "redis://ops:hunter2@host:6379?master_name=m&no_such=1"} {
		_, _, err := redisurl.Dial(u, redisurl.Settings{})
		if !errors.Is(err, redisurl.ErrBadURL) || strings.Contains(err.Error(), "hunter2") {
			t.Errorf("Dial(%s) error = %v, want ErrBadURL without the password", u, err)
		}
	}
	if got := redisurl.Redacted("redis://ops:hunter2@host:6379"); strings.Contains(got, "hunter2") {
		t.Errorf("Redacted = %s", got)
	}
}

// enableTLS gives s a TLS port with a fresh self-signed certificate and
// returns the port.
func enableTLS(t *testing.T, s *redistest.Server) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "127.0.0.1"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cert, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	_ = ln.Close()
	ctx := context.Background()
	admin := s.Client(t)
	for _, kv := range [][2]string{{"tls-cert-file", cert}, {"tls-key-file", keyFile}, {"tls-ca-cert-file", cert},
		{"tls-auth-clients", "no"}, {"tls-port", port}} {
		if err := admin.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
			t.Skipf("this redis-server has no TLS (%s: %v)", kv[0], err)
		}
	}
	return port
}
