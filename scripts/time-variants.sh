#!/usr/bin/env bash
# Runs on the H200 (device tool, carry .device and .gl), after scripts/build-variants.sh: times every
# packed runner on OPS (default: the SISO scan) with `bench --detail`, Vulkan with the driver's
# pipeline statistics, then CUDA unless NOCUDA=1; COMPARE=1 adds `compare` per variant, SASS="a b"
# dumps those variants' Vulkan pipelines (for scripts/vk-sass.py), CHUNKS="32 48" also times the
# last variant at those chunk sizes (`bench --scalar chunk_size=C`, Vulkan), SPLIT="a b" also times
# those variants on Vulkan with MAMBA_SISO_STATE_PASSING=split, SAVED="a b" times those variants
# again with `bench --save-for-backward` (the SISO forward saves, the backward reads). Logs go to $OUT.
#   usage: scripts/time-variants.sh   (VARIANTS="run-a run-b" picks and orders them)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
source scripts/device-env.sh
mkdir -p /tmp/variants && tar -C /tmp/variants -xJf .device/variants.tar.xz
ops=${OPS:-mamba3_siso_fwd,mamba3_siso_bwd}
for r in ${VARIANTS:-$(ls /tmp/variants)}; do
  n=${r#run-}
  export MAMBA_CACHE_DIR=/tmp/cache-$n
  echo "== $n vulkan"
  MAMBA_VK_PIPELINE_STATS=1 /tmp/variants/$r bench --backend vulkan --ops "$ops" --repeats 20 --detail >"$out/$n.vk.txt" 2>&1
  grep -E "^\| |Register|rror" "$out/$n.vk.txt" | grep -vE "column_sum|copy_f32" | sed 's/Binary Size.*Shared/Shared/'
  if [[ " ${SPLIT:-} " == *" $n "* ]]; then
    echo "== $n vulkan, split state passing"
    MAMBA_SISO_STATE_PASSING=split /tmp/variants/$r bench --backend vulkan --ops "$ops" --repeats 20 --detail >"$out/$n.split.vk.txt" 2>&1
    grep -E "^\| |rror" "$out/$n.split.vk.txt" | grep -vE "column_sum|copy_f32"
  fi
  if [[ " ${SAVED:-} " == *" $n "* ]]; then
    echo "== $n vulkan, saved for backward"
    MAMBA_VK_PIPELINE_STATS=1 /tmp/variants/$r bench --backend vulkan --ops "$ops" --repeats 20 --detail \
      --save-for-backward >"$out/$n.saved.vk.txt" 2>&1
    grep -E "^\| |Register|rror" "$out/$n.saved.vk.txt" | grep -vE "column_sum|copy_f32" | sed 's/Binary Size.*Shared/Shared/'
  fi
  if [ "${NOCUDA:-0}" = 0 ]; then
    echo "== $n cuda"
    /tmp/variants/$r bench --backend cuda --ops "$ops" --repeats 20 --detail >"$out/$n.cu.txt" 2>&1
    grep -E "^\| |rror" "$out/$n.cu.txt"
  fi
  if [ "${COMPARE:-0}" != 0 ]; then
    /tmp/variants/$r compare --backends vulkan,cuda --size small >"$out/$n.compare.txt" 2>&1
    echo "$n: largest Vulkan-CUDA difference: $(grep -E '^\| ' "$out/$n.compare.txt" | sort -t'|' -k4 -g | tail -1)"
  fi
done
last=$(ls /tmp/variants | tail -1)
[ -n "${VARIANTS:-}" ] && last=${VARIANTS##* }
for c in ${CHUNKS:-}; do
  n=${last#run-}
  echo "== $n vulkan, chunk $c"
  MAMBA_CACHE_DIR=/tmp/cache-$n /tmp/variants/$last bench --backend vulkan --ops "$ops" --repeats 20 --detail \
    --scalar chunk_size=$c >"$out/$n.chunk$c.vk.txt" 2>&1
  grep -E "^\| |rror" "$out/$n.chunk$c.vk.txt" | grep -vE "column_sum|copy_f32"
done
for n in ${SASS:-}; do
  rm -rf /tmp/vkbin-$n && mkdir -p /tmp/vkbin-$n
  MAMBA_VK_PIPELINE_BINARY_DIR=/tmp/vkbin-$n MAMBA_CACHE_DIR=/tmp/cache-sass-$n \
    /tmp/variants/run-$n bench --backend vulkan --ops "$ops" --repeats 1 >/dev/null 2>&1
done
if [ -n "${SASS:-}" ]; then
  tar -C /tmp -cJf "$out/vkbin.tar.xz" $(for n in $SASS; do echo vkbin-$n; done) && ls -la "$out/vkbin.tar.xz"
fi
