package remote

import (
	"testing"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
)

func TestMain(m *testing.M) { redistest.Main(m) }
