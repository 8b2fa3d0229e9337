# The README's commands. Every target first runs the idempotent setup, which
# installs whatever Debian / PyPI packages are missing.
.PHONY: all setup build demo test unit-test integration-test gpu-bundle clean

BAZEL ?= bazel
BAZEL_FLAGS ?=
BINARIES = client/shardgemm client/shardgemm-service-bench client/shardgemm-transport-bench client/shardgemm-health-probe server/shardgemm-coordinator worker/shardgemm-worker

all: build

setup:
	@bash tools/setup.sh

build: setup
	$(BAZEL) build $(BAZEL_FLAGS) //...
	@mkdir -p bin
	@bb=$$($(BAZEL) info $(BAZEL_FLAGS) bazel-bin 2>/dev/null); \
	for b in $(BINARIES); do install -m 755 $$bb/$$b bin/; done; \
	install -m 755 $$bb/kernels/cuda/grouped_gemm_bench bin/shardgemm-bench
	@python3 tools/gen_python_proto.py
	@echo "binaries in ./bin: $$(ls bin | tr '\n' ' ')"

demo: build
	@bash tools/demo.sh

# Unit tests (Bazel) and integration tests (real processes on loopback),
# then one summary line counting test cases.
test: build
	@bash tools/run_tests.sh

clean:
	$(BAZEL) clean
	rm -rf bin client/python/shardgemm_pb client/python/shardgemm/_pb client/python/build client/python/dist client/python/*.egg-info

# Container images (podman; tools/image/setup_podman.sh installs and configures
# it, tools/image/make_base.sh makes the Debian base when it is missing) and the
# one-host container mesh test. See docs/deploy.md.
.PHONY: image image-cuda image-test
image:
	@bash tools/image/build.sh cpu

image-cuda:
	@bash tools/image/build.sh cuda

image-test: build image
	@bash tests/image_test.sh
