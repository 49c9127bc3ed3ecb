// Package doccheck holds the test that builds every Go block of the README
// and docs/: a module of its own, because the blocks use the contrib
// adapters (Prometheus, OpenTelemetry, gRPC) whose dependencies stay out
// of leasehold's go.mod.
package doccheck
