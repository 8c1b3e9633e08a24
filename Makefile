# perspective-operator — the two commands of the README, plus the benchmark.
#   make demo    embedded PostgreSQL, migrate examples/shop.yaml, append sample events, apply them, print the tables
#   make test    lint, then every test against a real PostgreSQL (installed with apt-get if missing)
#                and, for the operator, a real Kubernetes control plane on loopback (tests/e2e/),
#                then the real-node scenarios (a kubelet with containerd, runc and the CNI bridge)
#   make bench   append-path, apply-path, backfill, cross-stream read-model, latency, rollout and blue/green
#                benchmarks (see BENCHMARKS.md)
#   make bench-scale  how the cost grows with history, breadth, fan-out, a hot stream and churn
#                (~15 min; appends its table to docs/benchmarks-history.md)
#   make images  the worker and operator container images, built with buildah
#   make plugin  the kubectl plugin `kubectl pd` (put kubectl-pd on your PATH; docs/day-two.md)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

# Builds are cached outside the checkout so a fresh clone on a warm machine is fast.
export CARGO_TARGET_DIR ?= $(HOME)/.cache/perspective-operator/target
CARGO ?= cargo
PG := tests/pg/pg.sh
WORKER := $(CARGO_TARGET_DIR)/debug/perspective-worker

.PHONY: all build lint fmt test unit integration demo bench bench-scale images plugin postgres clean-cache

all: build

build:
	$(CARGO) build --workspace --all-targets

fmt:
	$(CARGO) fmt --all

lint:
	$(CARGO) fmt --all -- --check
	python3 tests/lint/architecture.py
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Installs the PostgreSQL server package when no server binaries are present.
postgres:
	@$(PG) bindir >/dev/null

# Two control planes, one after the other: one with kwok nodes (pods simulated; tests named
# real_node::* skipped), where tests/run-suites.sh runs the test binaries in three concurrent
# streams (they mostly wait), and one with a real kubelet node (containerd, runc; the images
# built by tests/e2e/images.sh). (The two control planes side by side made the real node's
# teardown flaky: node.sh's leftover check saw veths the kernel had not yet removed.)
# The test binaries are built first, per package as tests/run-suites.sh runs them (`cargo test
# --workspace` resolves features across both packages, so its worker binaries differ from
# `-p perspective-worker`'s and the suites rebuilt each of them mid-run).
test: postgres lint
	$(CARGO) test -p perspective-worker --no-run
	$(CARGO) test -p perspective-operator --no-run
	$(PG) with tests/e2e/with-control-plane.sh env CARGO=$(CARGO) tests/run-suites.sh
	$(PG) with tests/e2e/with-control-plane.sh --real-node $(CARGO) test -p perspective-operator --test real_node

# A fresh embedded PostgreSQL each time (no DATABASE_URL), removed afterwards.
demo: postgres
	$(CARGO) build -p perspective-worker
	dir=$$(mktemp -d /tmp/perspective-demo.XXXXXX); chmod 755 $$dir; \
	trap 'rm -rf '$$dir EXIT; \
	env -u DATABASE_URL $(WORKER) --config examples/shop.yaml demo --events examples/shop-events.jsonl \
	  --data-dir $$dir/pgdata --http-addr 127.0.0.1:0

bench: postgres
	$(CARGO) build --release -p perspective-worker
	tests/bench/append.sh
	tests/bench/apply.sh
	tests/bench/backfill.sh
	PHASES=live LIVE_RATE=1000 DURABLE=1 tests/bench/backfill.sh
	tests/bench/crossstream.sh
	tests/bench/latency.sh
	STREAMS=10 RATES=1000 tests/bench/latency.sh
	tests/bench/rollout.sh
	tests/bench/idle.sh
	tests/bench/bluegreen.sh

bench-scale: postgres
	$(CARGO) build --release -p perspective-worker
	tests/bench/scale.sh
	tests/bench/breadth-tables.sh

# Container images (buildah, no Docker engine): perspective-worker and perspective-operator.
images:
	images/build.sh

# The kubectl plugin: kubectl runs `kubectl-pd` from the PATH as `kubectl pd`.
plugin:
	$(CARGO) build -p perspective-operator --bin kubectl-pd
	@echo "built $(CARGO_TARGET_DIR)/debug/kubectl-pd: put it on your PATH, then: kubectl pd --help"

clean-cache:
	rm -rf $(CARGO_TARGET_DIR)
