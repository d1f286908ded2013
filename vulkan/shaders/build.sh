#!/usr/bin/env bash
# Compiles every vulkan/shaders/*.comp to SPIR-V beside it with the project's exact flags:
# glslc for all but the KHR cooperative-matrix shaders (*_khr.comp), which take glslang 13.1.1
# and spirv-opt -O (khr_toolchain.sh installs them; FOXEDGE_GLSLANG names the install).
# Usage: vulkan/shaders/build.sh [OUTPUT_DIR]   (default: the shaders directory itself)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here}"
mkdir -p "$out"
khr=""
for src in "$here"/*.comp; do
  name="$(basename "$src" .comp)"
  case "$name" in
    *_khr)
      if [ -z "$khr" ]; then
        dir="${FOXEDGE_GLSLANG:-$HOME/.cache/foxedge/glslang-13.1.1}"
        khr="$dir/cmeel.prefix"
        [ -x "$khr/bin/glslangValidator" ] || {
          echo "no glslang for $name.comp in $dir: run vulkan/shaders/khr_toolchain.sh" >&2
          exit 1
        }
      fi
      LD_LIBRARY_PATH="$khr/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$khr/bin/glslangValidator" -V --quiet --target-env vulkan1.2 -I"$here" "$src" -o "$out/$name.unopt.spv" >/dev/null
      LD_LIBRARY_PATH="$khr/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$khr/bin/spirv-opt" -O --target-env=vulkan1.2 "$out/$name.unopt.spv" -o "$out/$name.spv"
      rm -f "$out/$name.unopt.spv"
      ;;
    *) glslc --target-env=vulkan1.2 -O -I "$here" "$src" -o "$out/$name.spv" ;;
  esac
done
