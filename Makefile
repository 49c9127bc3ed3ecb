# make test: what CI runs (.ci/run) and what a newcomer runs on a fresh
# machine. It installs redis-server when missing (Debian, as root), then runs
# every test with the race detector and real Redis required.
GO ?= go
export LEASEHOLD_REQUIRE_REDIS ?= 1
# staticcheck is pinned and run with go run, so a fresh machine needs
# nothing installed by hand.
STATICCHECK ?= $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2
# Nested modules (go.work ties them to the root): their dependencies stay
# out of leasehold's go.mod.
MODULES = benchmarks internal/doccheck internal/faulttest sim contrib/prommetrics contrib/otelmetrics contrib/grpclimit contrib/envoyrls
# Modules whose tests make test runs besides the root's, one after the
# other: ALONE first, on a machine with nothing else running (its faults
# are timed), then TESTED while the simulator's run beside them
# (deterministic, in virtual time: load cannot move its figures); its
# output is printed when it ends.
ALONE = internal/faulttest
TESTED = internal/doccheck contrib/prommetrics contrib/otelmetrics contrib/grpclimit contrib/envoyrls benchmarks
BESIDE = sim

.PHONY: test redis lint bench bench-cold bench-cluster bench-envoy bench-peers figures sim fuzz soak

# Every module's tests run even when one fails; the summary names what
# failed and the target fails if anything did.
test: redis lint
	@failed=""; \
	$(GO) test -race -count=1 -timeout 12m ./... || failed="$$failed ."; \
	for m in $(ALONE); do \
		echo "# $$m"; \
		(cd $$m && $(GO) test -race -count=1 -timeout 5m ./...) || failed="$$failed $$m"; \
	done; \
	beside=$$(mktemp); \
	(cd $(BESIDE) && $(GO) test -race -count=1 -timeout 5m ./... > $$beside 2>&1; echo "rc=$$?" >> $$beside) & \
	for m in $(TESTED); do \
		echo "# $$m"; \
		(cd $$m && $(GO) test -race -count=1 -timeout 5m ./...) || failed="$$failed $$m"; \
	done; \
	wait; \
	echo "# $(BESIDE)"; cat $$beside; \
	grep -q '^rc=0$$' $$beside || failed="$$failed $(BESIDE)"; \
	rm -f $$beside; \
	if [ -n "$$failed" ]; then echo "make test: FAILED in modules:$$failed"; exit 1; fi; \
	echo "make test: every module passed"

lint:
	@unformatted="$$(gofmt -l .)"; if [ -n "$$unformatted" ]; then echo "gofmt needed:"; echo "$$unformatted"; exit 1; fi
	$(GO) vet ./...
	GOARCH=386 $(GO) vet ./...  # 64-bit atomics must build on 32-bit targets
	$(STATICCHECK) ./...
	for m in $(MODULES); do (cd $$m && $(GO) vet ./... && $(STATICCHECK) ./...) || exit 1; done

redis:
	@if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then \
		redis-server --version; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing redis-server (Debian)"; \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server redis-tools; \
	else \
		echo "redis-server and redis-cli are required: install them (Debian: sudo apt-get install -y redis-server) and re-run"; \
		exit 1; \
	fi

# BENCH_HEADER prints the run's machine and commit above each results file.
BENCH_HEADER = echo "date: $$(date -u +%Y-%m-%dT%H:%MZ)"; echo "commit: $$(git rev-parse --short HEAD 2>/dev/null)"; \
	echo "cores: $$(nproc)"; echo "go: $$($(GO) env GOVERSION)"; echo "redis: $$(redis-server --version | cut -d' ' -f3)"

# Benchmarks: the hybrid fast path (./hybrid), the local GCRA (./local),
# then the benchmarks module: hybrid, redis_rate and x/time/rate on one real
# Redis, every workload and concurrency, written in benchstat format (with
# the machine it ran on) to benchmarks/results/latest.txt.
bench: redis
	$(GO) test -run '^$$' -bench . -benchmem ./local/ ./hybrid/
	mkdir -p benchmarks/results
	{ $(BENCH_HEADER); cd benchmarks && $(GO) test -run '^$$' -bench . -skip '^BenchmarkClusterOverflow$$' -benchmem -timeout 30m .; } | tee benchmarks/results/latest.txt.tmp
	mv benchmarks/results/latest.txt.tmp benchmarks/results/latest.txt
	# Medians of 5 rounds of the Zipf rows (about 16 minutes): one run swings.
	{ $(BENCH_HEADER); cd benchmarks && LEASEHOLD_BENCH_RATIOS=1 $(GO) test -count=1 -timeout 40m -run '^TestZipfRatios$$' -v .; } | tee benchmarks/results/ratios.txt.tmp
	mv benchmarks/results/ratios.txt.tmp benchmarks/results/ratios.txt
	$(MAKE) bench-cold
	$(MAKE) bench-cluster
	$(MAKE) bench-envoy
	$(MAKE) bench-peers

# Envoy's rate limit service (contrib/envoyrls) over real gRPC on
# loopback, its server a process of its own (about 1 minute), to
# benchmarks/results/envoyrls.txt: requests per second of the server's
# CPU, p50/p99, Redis calls per 1 000 requests, beside a server that
# decides nothing.
bench-envoy: redis
	mkdir -p benchmarks/results
	{ $(BENCH_HEADER); cd contrib/envoyrls && $(GO) test -run '^$$' -bench . -benchtime 100000x -count 2 -timeout 10m .; } | tee benchmarks/results/envoyrls.txt.tmp
	mv benchmarks/results/envoyrls.txt.tmp benchmarks/results/envoyrls.txt

# gubernator beside leasehold and redis_rate (benchmarks/peers, a module of
# its own outside the workspace: gubernator's dependencies take about
# 1 m 40 s to compile the first time), in one run of about 2 minutes, to
# benchmarks/results/peers.txt: accuracy at twice a key's limit across 4
# daemons or limiters, then decisions/s, latency, CPU and allocations per
# decision on a hot key and on 100 000 Zipf keys at 1, 16 and 256
# goroutines.
bench-peers: redis
	mkdir -p benchmarks/results
	{ $(BENCH_HEADER); cd benchmarks/peers && GOWORK=off LEASEHOLD_PEERS=1 $(GO) test -count=1 -timeout 20m -run '^TestPeers$$' -v . | grep -v -e '^=== ' -e 'pool.go'; } | tee benchmarks/results/peers.txt.tmp
	mv benchmarks/results/peers.txt.tmp benchmarks/results/peers.txt

# Cold decisions alone, and the layers they pass through, 9 rounds in
# alternating order (about 5 minutes), to
# benchmarks/results/cold.txt: the last step of make bench, and on its own
# after a change to the cold path.
bench-cold: redis
	{ $(BENCH_HEADER); cd benchmarks && LEASEHOLD_BENCH_RATIOS=1 $(GO) test -count=1 -timeout 20m -run '^TestColdRatios$$' -v .; } | tee benchmarks/results/cold.txt.tmp
	mv benchmarks/results/cold.txt.tmp benchmarks/results/cold.txt

# The Zipf workload on the real 3-master cluster with go-redis's default
# pool per node (about 2 minutes), to benchmarks/results/cluster.txt: what
# pipelining the calls beyond a node's pool is worth there.
bench-cluster: redis
	{ $(BENCH_HEADER); cd benchmarks && $(GO) test -run '^$$' -bench '^BenchmarkClusterOverflow$$' -benchmem -benchtime 200000x -timeout 20m .; } | tee benchmarks/results/cluster.txt.tmp
	mv benchmarks/results/cluster.txt.tmp benchmarks/results/cluster.txt

sim:
	$(GO) run ./sim

fuzz:
	$(GO) test -run '^$$' -fuzz FuzzBucketTakeAt -fuzztime 30s ./local/
	$(GO) test -run '^$$' -fuzz FuzzKeys -fuzztime 30s ./internal/keys/
	$(GO) test -run '^$$' -fuzz FuzzLimitValidate -fuzztime 30s ./remote/

# The random-fault soak of RELIABILITY.md for 10 minutes (make test runs it
# for 15 s).
soak: redis
	LEASEHOLD_SOAK_DURATION=10m $(GO) test -race -count=1 -timeout 15m -run '^TestSoak$$' -v ./hybrid/

# The regression figures of a change to the core, in one run (about 80
# s): the hot path and a flood beside x/time/rate, utilization of 4
# OS processes at 0.9–2× demand with the every-window audit, store calls
# under and at the limit, a partition of 2 of 6 limiters. Run it before
# and after the change and put both tables in the note; the last run's
# table is in benchmarks/results/figures.txt.
# LEASEHOLD_FIGURES_VARIANT=stock runs every limiter with stock records
# and no flow, to benchmarks/results/figures-stock.txt.
FIGURES_OUT = benchmarks/results/figures$(if $(LEASEHOLD_FIGURES_VARIANT),-$(LEASEHOLD_FIGURES_VARIANT)).txt
figures: redis
	mkdir -p benchmarks/results
	{ $(BENCH_HEADER); cd benchmarks && LEASEHOLD_FIGURES=1 $(GO) test -v -count=1 -timeout 15m -run '^TestRegressionFigures$$' . | grep -v '^    figures_test'; } | tee $(FIGURES_OUT).tmp
	mv $(FIGURES_OUT).tmp $(FIGURES_OUT)
