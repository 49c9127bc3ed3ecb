package grpclimit_test

import (
	"testing"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
)

// TestMain stops the Redis servers the examples started.
func TestMain(m *testing.M) { redistest.Main(m) }
