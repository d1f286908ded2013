#!/usr/bin/env bash
# Recompiles every shader into a temporary directory and fails if any committed .spv
# differs from what its GLSL compiles to (or is missing, or has no source).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$here/build.sh" "$tmp"
status=0
for spv in "$tmp"/*.spv; do
  name="$(basename "$spv")"
  if ! cmp -s "$spv" "$here/$name"; then
    echo "SPIR-V out of date: vulkan/shaders/$name (run vulkan/shaders/build.sh)" >&2
    status=1
  fi
done
for spv in "$here"/*.spv; do
  [ -e "$tmp/$(basename "$spv")" ] || { echo "stale SPIR-V without source: $spv" >&2; status=1; }
done
# The KHR cooperative-matrix shaders run on no CI device (lavapipe has no cooperative
# matrices): spirv-val of the same SPIRV-Tools checks them against the Vulkan 1.3 rules.
for spv in "$tmp"/*_khr.spv; do
  [ -e "$spv" ] || continue
  khr="${FOXEDGE_GLSLANG:-$HOME/.cache/foxedge/glslang-13.1.1}/cmeel.prefix"
  LD_LIBRARY_PATH="$khr/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$khr/bin/spirv-val" --target-env vulkan1.3 "$spv" || { echo "invalid SPIR-V: $(basename "$spv")" >&2; status=1; }
done
[ "$status" = 0 ] && echo "SPIR-V matches its GLSL ($(ls "$tmp"/*.spv | wc -l) shaders)"
exit "$status"
