// Package hybrid is leasehold's public limiter: one global rate limit per
// key, shared by every process that uses the same store, decided locally.
//
// Each process leases small batches of tokens from the store (one atomic
// Redis script call) and spends them from a lock-free cell, so a decision on
// a busy key is a map lookup and a CAS. Batches follow each key's recent
// demand, never exceed a fraction of Burst, and are refilled in the
// background before they run dry; unused tokens go back to the store when a
// lease expires, when a key is evicted and on Close. Because every token
// spent was granted by the store first, the fleet never admits more than
// Burst + Rate·elapsed/Period on a key.
//
// A key at its limit is cheap: the store's "empty until T" is cached, and
// when the bucket is contended the store grants future-dated leases (GCRA
// reservations) so every call it answers delivers a useful batch.
//
// A Policy is a token bucket (GCRA) by default. It can instead be a sliding
// window (at most Rate in any Period, Algorithm SlidingWindow), carry
// several limits that every admission must fit (Also), and name tiers of
// limits that keys are put under by WithTier; all are decided by one store
// call per lease and versioned together in the policy record.
//
// When the store fails or is slower than the store timeout, decisions fall
// back to the configured OutageMode instead of returning errors.
//
// A fleet that spans regions passes each region's limiters a
// tiered.Store (package remote/tiered): it answers from the region's own
// Redis and refills from the world's in the background, so one limit holds
// across regions and no decision waits for another region (see the
// package's example).
package hybrid
