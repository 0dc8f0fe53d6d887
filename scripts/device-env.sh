# Sourced on the H200 by scripts/gpu-check.sh and scripts/time-variants.sh, from the repository
# root with .gl/ carried: unpacks the Vulkan loader packages, points the loader at NVIDIA's ICD
# when no driver manifest is installed, and puts NVRTC on the library path for cudarc.
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
if ! ls /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json >/dev/null 2>&1; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
nvrtc=$(find / -name 'libnvrtc.so*' -not -path '*/proc/*' 2>/dev/null | grep -v alt | head -1)
[ -n "$nvrtc" ] && export LD_LIBRARY_PATH="$(dirname "$nvrtc"):${LD_LIBRARY_PATH:-}"
