package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

func getStatus(t *testing.T, base string) statusReport {
	t.Helper()
	resp, err := http.Get(base + "/status.json")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var r statusReport
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		t.Fatal(err)
	}
	return r
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond) // polling the running demo with a deadline
	}
}

// TestDemo runs the demo on an embedded miniredis: the load generator runs
// the tenants over their limit, the page and the JSON answer, and cutting
// the store off shows degraded mode, then the recovery.
func TestDemo(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"-addr", "127.0.0.1:0", "-rate", "20", "-load", "50"}, io.Discard, ready)
	}()
	base := "http://" + <-ready
	waitFor(t, "a second with admissions and rejections", func() bool {
		for _, s := range getStatus(t, base).Seconds {
			if s.Admitted > 0 && s.Rejected > 0 {
				return true
			}
		}
		return false
	})
	resp, err := http.Get(base + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "leasehold demo") {
		t.Fatal("the status page is not served")
	}
	toggle := func() {
		resp, err := http.Post(base+"/outage", "", nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	toggle()
	waitFor(t, "degraded mode", func() bool { return getStatus(t, base).Mode == "degraded" })
	toggle()
	waitFor(t, "recovery", func() bool { return getStatus(t, base).Mode == "healthy" })
	cancel()
	if err := <-done; err != nil && err != context.Canceled {
		t.Fatalf("run: %v", err)
	}
}

// TestFlags: -h prints the usage once and exits 0; a bad flag or argument
// exits 2 with one line that names it.
func TestFlags(t *testing.T) {
	for _, tc := range []struct {
		args     []string
		code     int
		has      string
		lines    int // lines on stderr, 0 for any
		usageOut int // times "usage:" appears
	}{
		{[]string{"-h"}, 0, "-rate", 0, 1},
		{[]string{"-help"}, 0, "-outage", 0, 1},
		{[]string{"-nope"}, 2, "flag provided but not defined: -nope", 1, 0},
		{[]string{"-rate", "0"}, 2, "-rate must be positive", 1, 0},
		{[]string{"extra"}, 2, `unexpected argument "extra"`, 1, 0},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stderr strings.Builder
			_, err := parse(tc.args, &stderr)
			code := exitCode(err, &stderr)
			out := stderr.String()
			if code != tc.code || !strings.Contains(out, tc.has) || strings.Count(out, "usage: leasehold-demo") != tc.usageOut ||
				tc.lines > 0 && strings.Count(out, "\n") != tc.lines {
				t.Fatalf("exit %d (want %d), output:\n%s", code, tc.code, out)
			}
		})
	}
}
