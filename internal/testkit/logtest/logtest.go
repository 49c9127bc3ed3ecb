// Package logtest holds a log sink for tests: a buffer that loggers may
// write from background goroutines while the test reads it.
package logtest

import (
	"strings"
	"sync"
)

// Buffer is a strings.Builder safe for concurrent writes and reads.
type Buffer struct {
	mu sync.Mutex
	b  strings.Builder
}

// Write appends p.
func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns what was written so far.
func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
