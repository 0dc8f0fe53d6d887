#!/usr/bin/env bash
# Builds, on this machine, everything the H200 run needs and copies it into .device/ (git-ignored):
# the runner and every test executable, with the CUDA feature, stripped. The device tool carries
# .device/ and .gl/ (the Vulkan loader packages); scripts/gpu-check.sh runs there and builds nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
rm -rf .device && mkdir -p .device/release/deps .device/release/examples
cargo build --release --features cuda --example run
cp target/release/examples/run .device/release/examples/run
cargo test --release --features cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        shutil.copy(m["executable"], ".device/release/deps/")
        print(m["executable"])
'
strip .device/release/deps/* .device/release/examples/run
# The executables embed every kernel's CUDA source; compressed they fit the device tool's 64 MiB.
tar -C .device -cJf .device/bundle.tar.xz release && rm -rf .device/release
du -sh .device
