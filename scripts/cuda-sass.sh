#!/usr/bin/env bash
# Machine code of the CUDA kernels without a GPU: NVRTC (from `make setup`) compiles every kernel
# file as the CUDA backend does (same source, options and occupancy targets), `cuobjdump` reports
# registers, stack and shared memory per entry point, and `nvdisasm` writes the SASS, with a count
# of instructions by opcode, for reading where a kernel's issue slots go.
#
#   scripts/cuda-sass.sh [ARCH] [OUT_DIR]      (default sm_90 and target/cuda-sass)
#
# The disassembler comes from PyPI (nvidia-cuda-nvdisasm, nvidia-cuda-cuobjdump) into .tools on
# first use. NVIDIA's Vulkan compiler is another front end over the same back end: its registers
# and schedule differ (docs/PERFORMANCE.md), so this reads the CUDA build, not the Vulkan one.
set -euo pipefail
cd "$(dirname "$0")/.."
arch="${1:-sm_90}"
# the architectures tests/cuda_compile.rs compiles for
case "$arch" in sm_90 | sm_80) ;; *) echo "cuda-sass: ARCH must be sm_90 or sm_80" >&2; exit 2 ;; esac
out="${2:-target/cuda-sass}"
tools="$PWD/.tools"
./scripts/setup.sh >/dev/null
bin="$tools/cuda-binutils/nvidia/cu13/bin"
if [ ! -x "$bin/nvdisasm" ] || [ ! -x "$bin/cuobjdump" ]; then
  mkdir -p "$tools/cuda-binutils"
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$tools/cuda-binutils" \
    "nvidia-cuda-nvdisasm==13.5.37" "nvidia-cuda-cuobjdump==13.5.37"
  chmod +x "$bin/nvdisasm" "$bin/cuobjdump"
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
MAMBA_CUBIN_DIR="$out" LD_LIBRARY_PATH="$tools/nvrtc/nvidia/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  cargo test --release --features cuda --test cuda_compile -q >/dev/null
for cubin in "$out"/*."$arch".cubin; do
  name="$(basename "$cubin" ".$arch.cubin")"
  "$bin/nvdisasm" -c "$cubin" > "$out/$name.$arch.sass" 2>/dev/null
  echo "== $name ($arch)"
  "$bin/cuobjdump" -res-usage "$cubin" | awk '/Function/{f=$2} /REG:/{print "  " f " " $1 " " $2 " " $4}'
  awk '/\/\*[0-9a-f]+\*\/ /{ for (i = 2; i <= NF; i++) if ($i ~ /^[A-Z][A-Z0-9_]*(\.|$)/) { split($i, op, "."); n[op[1]]++; t++; break } }
       END { printf "  %d instructions:", t; for (k in n) if (n[k] * 50 >= t) printf " %s %d", k, n[k]; printf "\n" }' \
    "$out/$name.$arch.sass"
done
echo "SASS in $out/*.$arch.sass"
