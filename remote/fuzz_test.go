package remote

import (
	"errors"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/leasehold/leasehold/local"
)

// FuzzLimitValidate: a limit either fails with ErrInvalidLimit or is one
// every store can run: a request with it validates, a lease of Burst on a
// fresh MemoryStore bucket is granted in full, and a policy record of it
// (any valid version) survives the store's text form unchanged.
func FuzzLimitValidate(f *testing.F) {
	f.Add(int64(5), int64(time.Second), int64(3), uint64(1))
	f.Add(int64(1), int64(365*24*time.Hour), int64(2), uint64(7))
	f.Add(int64(1e9), int64(time.Second), int64(1e12), uint64(1)<<53)
	f.Add(int64(100_003), int64(24*time.Hour), int64(100_003), uint64(2))
	f.Add(int64(-1), int64(time.Second), int64(1), uint64(0))
	f.Add(int64(1), int64(1), int64(1<<62), uint64(1)<<60)
	f.Fuzz(func(t *testing.T, rate, period, burst int64, version uint64) {
		lim := local.Limit{Rate: rate, Period: time.Duration(period), Burst: burst}
		err := lim.Validate()
		if err != nil {
			if !errors.Is(err, local.ErrInvalidLimit) {
				t.Fatalf("Validate(%v) = %v, want ErrInvalidLimit", lim, err)
			}
			return
		}
		r := Request{Policy: "p", Key: "k", Limit: lim, Version: 1, N: burst}
		m, err := validate(OpLease, &r)
		if err != nil {
			t.Fatalf("valid limit %v: request refused: %v", lim, err)
		}
		st, res := apply(state{}, false, OpLease, &r, m, 1_700_000_000_000_000)
		if res.Granted != burst || st.level != 0 {
			t.Fatalf("valid limit %v: lease of Burst on a fresh bucket = %+v", lim, res)
		}
		rec := PolicyRecord{Version: version, Limit: lim}
		if err := validatePolicyRecord("", "p", rec); err != nil {
			if version == 0 || version > MaxVersion {
				return
			}
			t.Fatalf("record %+v refused: %v", rec, err)
		}
		text := fmt.Sprintf("%d %d %d %d", rec.Version, lim.Rate, int64(lim.Period/time.Microsecond), lim.Burst)
		back, err := decodePolicy("k", text)
		if err != nil || !reflect.DeepEqual(back, rec) {
			t.Fatalf("record %+v as %q decodes to %+v, %v", rec, text, back, err)
		}
	})
}
