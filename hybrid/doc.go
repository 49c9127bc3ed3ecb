// Package hybrid is leasehold's public limiter: one global rate limit per
// key, shared by every process that uses the same store, decided locally.
//
// In a service, one Limiter per policy lives as long as the process:
//
//	rdb := redis.NewClient(&redis.Options{
//		Addr:                  "redis.internal:6379",
//		ContextTimeoutEnabled: true, // required: deadlines must reach calls in flight
//	}) // or redis.NewClusterClient, redis.NewFailoverClient
//	lim, err := hybrid.New(remote.NewRedis(rdb), hybrid.Policy{
//		Name:  "api",                  // buckets are per policy and key
//		Limit: hybrid.PerSecond(1000), // for the whole fleet
//	})
//	if err != nil {
//		return err
//	}
//	defer lim.Close(ctx) // gives unspent leased tokens back
//
//	d, err := lim.AllowN(ctx, customerID, 1)
//	switch {
//	case err != nil: // misuse: ErrInvalidKey (no customer id), ErrExceedsBurst, ErrClosed
//		http.Error(w, "bad request", http.StatusBadRequest)
//	case !d.Allowed: // a refusal: wait d.RetryAfter
//		http.Error(w, "slow down", http.StatusTooManyRequests)
//	}
//
// Redis being slow or down is never an error of AllowN: it changes Mode
// and decisions fall back to the OutageMode. hybrid/httplimit does the
// above for net/http, with draft-11 RateLimit fields.
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
