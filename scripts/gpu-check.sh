#!/usr/bin/env bash
# Runs on the H200 through the device tool, from the repository root, with .device/ (made by
# scripts/build-gpu-bundle.sh) and .gl/ carried. Builds nothing. Prints: the devices, the parity
# suite on Vulkan (NVIDIA driver) and CUDA, the largest difference between the two backends per op,
# the CUDA cold and warm start, and the benchmark tables. Logs go to $OUT when it is set.
#   usage: scripts/gpu-check.sh [suite] [compare] [bench] [sanitize] [sass] [ir]
#   (default: suite compare bench)
set -uo pipefail
cd "$(dirname "$0")/.."
steps="${*:-suite compare bench}"
run=.device/release/examples/run
out="${OUT:-/tmp}"

[ -f .device/bundle.tar.xz ] && tar -C .device -xJf .device/bundle.tar.xz
source scripts/device-env.sh
export MAMBA_CACHE_DIR=/tmp/mamba-cache
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
"$run" devices

for step in $steps; do
  case "$step" in
    suite)
      echo "== parity suite (Vulkan required, CUDA run) =="
      for t in .device/release/deps/*; do
        case "$(basename "$t")" in cuda_compile-*) continue ;; esac # CI runs it; the CUDA suite compiles anyway
        MAMBA_REQUIRE_VULKAN=1 "$t" --test-threads 4 >"$out/suite-$(basename "$t").log" 2>&1
        echo "$(basename "$t"): $(grep -E '^test result' "$out/suite-$(basename "$t").log" | tail -1)"
        grep -E 'panicked|FAILED|skipped' "$out/suite-$(basename "$t").log" | sort | uniq -c | head -20
      done ;;
    compare)
      echo "== Vulkan vs CUDA, largest relative difference per output =="
      "$run" compare --backends vulkan,cuda --size small
      echo "== CUDA start: cold (empty cache), then warm (new process) =="
      rm -rf /tmp/mamba-cache-cold
      MAMBA_CACHE_DIR=/tmp/mamba-cache-cold "$run" startup
      MAMBA_CACHE_DIR=/tmp/mamba-cache-cold "$run" startup ;;
    bench)
      nvidia-smi --query-gpu=clocks.sm,clocks.mem,utilization.gpu,pstate --format=csv,noheader -lms 250 >"$out/clocks.log" 2>&1 &
      dmon=$!
      echo "== bench: Vulkan (with the driver's pipeline statistics) =="
      MAMBA_VK_PIPELINE_STATS=1 "$run" bench --backend vulkan --repeats 20 --detail
      echo "== bench: Vulkan, SISO scan on the tensor-core path (opt-in) =="
      MAMBA_MATRIX_PATH=tensor-cores MAMBA_VK_PIPELINE_STATS=1 "$run" bench --backend vulkan \
        --ops mamba3_siso_fwd,mamba3_siso_bwd --repeats 20 --detail
      echo "== bench: CUDA =="
      "$run" bench --backend cuda --repeats 20 --detail
      kill "$dmon" 2>/dev/null
      echo "== clocks during the bench (sm, memory, utilisation, p-state; samples every 250 ms) =="
      sort "$out/clocks.log" | uniq -c | sort -rn | head -8
      "$run" startup ;;
    sass)
      echo "== Vulkan pipelines' machine code, from pipeline-cache blobs =="
      rm -rf /tmp/vkbin /tmp/vksass && mkdir -p /tmp/vkbin /tmp/vksass
      MAMBA_VK_PIPELINE_BINARY_DIR=/tmp/vkbin MAMBA_CACHE_DIR=/tmp/mamba-cache-sass "$run" bench --backend vulkan --repeats 1 >/dev/null 2>&1
      # Disassembled afterwards on the build machine: scripts/vk-sass.py needs zstandard.
      "$run" bench --backend cuda --repeats 1 >/dev/null 2>&1
      for c in "$MAMBA_CACHE_DIR"/cuda/*.cubin; do cuobjdump -sass "$c" > "/tmp/vksass/cuda.$(basename "$c").sass" 2>&1; done
      tar -C /tmp -cJf "$out/sass.tar.xz" vkbin vksass && ls -la "$out/sass.tar.xz" ;;
    ir)
      echo "== machine code: Vulkan pipelines (driver internal representations) and CUDA cubins =="
      rm -rf /tmp/ir && mkdir -p /tmp/ir/vulkan /tmp/ir/cuda
      MAMBA_VK_PIPELINE_STATS=1 MAMBA_VK_PIPELINE_IR_DIR=/tmp/ir/vulkan "$run" bench --backend vulkan --repeats 3 >/dev/null 2>&1
      "$run" bench --backend cuda --repeats 3 >/dev/null 2>&1
      for c in "$MAMBA_CACHE_DIR"/cuda/*.cubin; do cuobjdump -sass "$c" > "/tmp/ir/cuda/$(basename "$c").sass" 2>&1; done
      ls /tmp/ir/vulkan | head -30
      tar -C /tmp/ir -cJf "$out/ir.tar.xz" . && ls -la "$out/ir.tar.xz" ;;
    sanitize)
      echo "== compute-sanitizer (memcheck, racecheck) on the CUDA backend =="
      for tool in memcheck racecheck; do
        timeout "${SANITIZE_SECONDS:-600}" compute-sanitizer --tool "$tool" --print-limit 10 \
          "$run" compare --backends cuda --size small 2>&1 | tail -4
      done ;;
  esac
done
