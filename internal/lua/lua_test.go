package lua

import (
	"context"
	"fmt"
	"testing"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
)

func TestMain(m *testing.M) { redistest.Main(m) }

// TestFormatWritesWholeNumbers runs format, and format_f (the %.0f
// fallback of servers whose C long is narrower than 64 bits), on a real
// Redis: both must write what Go's %d writes for every whole number the
// scripts keep, and a 64-bit server must take the fast path.
func TestFormatWritesWholeNumbers(t *testing.T) {
	c := redistest.Standalone(t).Client(t)
	ctx := context.Background()
	script := Prelude + `
local args = {}
for i = 2, #ARGV do args[#args + 1] = tonumber(ARGV[i]) or ARGV[i] end
return {format(ARGV[1], unpack(args)), format_f(ARGV[1], unpack(args)), tostring(format == string.format)}
`
	values := []int64{0, 1, -1, 9, 10, 42, -123_456, 1_764_800_000_123_456, 1<<53 - 1, -(1 << 53)}
	for _, v := range values {
		for _, tc := range []struct {
			format string
			args   []any
		}{
			{"%d", []any{v}},
			{"%07d", []any{v}},
			{"S %d %d", []any{v, 3}},
			{"%s %d %d", []any{"holder-1", v, -v}},
		} {
			want := fmt.Sprintf(tc.format, tc.args...)
			got, err := c.Eval(ctx, script, nil, append([]any{tc.format}, tc.args...)...).StringSlice()
			if err != nil {
				t.Fatalf("%q %v: %v", tc.format, tc.args, err)
			}
			if got[0] != want || got[1] != want {
				t.Errorf("%q %v: format %q, format_f %q, want %q", tc.format, tc.args, got[0], got[1], want)
			}
			if got[2] != "true" {
				t.Fatalf("a 64-bit server fell back to %%.0f")
			}
		}
	}
}
