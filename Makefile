# Two commands: `make run` (the main job on the default device) and `make test` (the whole suite).
# Both install what is missing first (scripts/setup.sh is idempotent).

CARGO ?= cargo
# The Vulkan suite must run, with the validation layer on: a missing device is a failure.
# NVRTC from .tools lets the CUDA compile test run on machines without CUDA.
TEST_ENV := MAMBA_VK_VALIDATION=1 MAMBA_REQUIRE_VULKAN=1 \
	LD_LIBRARY_PATH="$(CURDIR)/.tools/nvrtc/nvidia/cuda_nvrtc/lib$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}"

.PHONY: all setup run test bench build-gpu clean

all: test

setup:
	@./scripts/setup.sh

run: setup
	$(CARGO) run --release --example run -- demo

test: setup
	$(TEST_ENV) $(CARGO) test --release --features cuda -- --show-output

bench: setup
	$(CARGO) run --release --example run -- bench

clean:
	$(CARGO) clean
