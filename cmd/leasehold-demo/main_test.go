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
