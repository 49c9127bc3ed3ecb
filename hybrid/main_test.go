package hybrid

import (
	"testing"

	"github.com/leasehold/leasehold/internal/redistest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// goleak checks after the package's tests; redistest stops the servers.
	redistest.MainWith(m, func() error { return goleak.Find() })
}
