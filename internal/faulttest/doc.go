// Package faulttest holds fault-injection tests that need heavy
// dependencies (github.com/Shopify/toxiproxy/v2 and its tree). It is its own
// module so that none of them reach leasehold's go.mod; `make test` runs it.
package faulttest
