//go:build docdeps

package doccheck

// The packages the docs' Go blocks use beyond leasehold's own, so that
// go.mod holds them (the build tag keeps them out of every build).
import (
	_ "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	_ "github.com/leasehold/leasehold/contrib/envoyrls"
	_ "github.com/leasehold/leasehold/contrib/grpclimit"
	_ "github.com/leasehold/leasehold/contrib/otelmetrics"
	_ "github.com/leasehold/leasehold/contrib/prommetrics"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "github.com/redis/go-redis/v9/logging"
	_ "go.opentelemetry.io/otel"
	_ "google.golang.org/grpc"
)
