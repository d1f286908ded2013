#!/usr/bin/env bash
# The Vulkan backend's run on the GPU machine (device tool): unpacks the Vulkan loader
# carried in .gl/, checks that the NVIDIA Vulkan driver is found, then runs the prebuilt
# benchmark (.vkbin/vk_bench, built on the dev machine with
#   cargo build --release -p foxedge-vulkan --example vk_bench
# and copied to .vkbin/), which checks correctness on the device first and prints a table.
# Usage (repository root, on the GPU machine): bash vulkan/scripts/h100.sh [vk_bench args]
# Logs go to $OUT (or /tmp/vk_out when OUT is unset), file ${VK_LOG:-bench.log}.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp/vk_out}"
mkdir -p "$out"
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$icd" ] && ! ls /usr/share/vulkan/icd.d/*nvidia* >/dev/null 2>&1 && ! ls /etc/vulkan/icd.d/*nvidia* >/dev/null 2>&1; then
  export VK_DRIVER_FILES="$icd"
fi
echo "VK_DRIVER_FILES=${VK_DRIVER_FILES:-<default search>}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 | tee "$out/gpu.txt"
export FOXEDGE_FIXTURE_DIR="$PWD/tests/fixtures/fox-tiny-pro"
./.vkbin/vk_bench "$@" 2>&1 | tee "$out/${VK_LOG:-bench.log}"
status=${PIPESTATUS[0]}
echo "vk_bench exit status $status"
exit "$status"
