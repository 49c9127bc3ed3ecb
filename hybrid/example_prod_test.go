package hybrid_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

// uniq keeps runs apart on a server that outlives one.
func uniq() string { return strconv.FormatInt(time.Now().UnixNano(), 36) }

// Example is the production setup: a go-redis client with deadlines that
// reach calls in flight, one Limiter per policy for the process's life,
// and both kinds of answer handled (a refusal is a Decision; an error is
// misuse, such as a request without a customer id).
func Example() {
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{
		Addr:                  redistest.ExampleAddr(), // e.g. "redis.internal:6379"
		ContextTimeoutEnabled: true,                    // required: deadlines must reach calls in flight
	})
	defer rdb.Close()

	lim, err := hybrid.New(remote.NewRedis(rdb),
		hybrid.Policy{Name: "api", Limit: hybrid.PerMinute(3)}, // 3 a minute per customer, fleet-wide
		hybrid.WithLogger(slog.New(slog.DiscardHandler)))       // yours: slog.Default() by default
	if err != nil {
		panic(err)
	}
	defer lim.Close(ctx) // gives unspent leased tokens back

	handle := func(customerID string) string {
		d, err := lim.AllowN(ctx, customerID, 1)
		switch {
		case errors.Is(err, hybrid.ErrInvalidKey):
			return "400 missing customer id"
		case err != nil:
			return "503 " + err.Error() // ErrClosed while shutting down
		case !d.Allowed:
			return fmt.Sprintf("429 retry later (waiting: %v)", d.RetryAfter > 0)
		}
		return "200"
	}
	acme := "acme-" + uniq() // a customer id
	for _, id := range []string{acme, acme, acme, acme, ""} {
		fmt.Println(handle(id))
	}
	// Output:
	// 200
	// 200
	// 200
	// 429 retry later (waiting: true)
	// 400 missing customer id
}
