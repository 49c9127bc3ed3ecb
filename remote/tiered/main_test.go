package tiered

import (
	"testing"

	"github.com/leasehold/leasehold/internal/redistest"
)

func TestMain(m *testing.M) { redistest.Main(m) }
