#!/usr/bin/env bash
# Compiles every vulkan/shaders/*.comp to SPIR-V beside it with the project's exact flags.
# Usage: vulkan/shaders/build.sh [OUTPUT_DIR]   (default: the shaders directory itself)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here}"
mkdir -p "$out"
for src in "$here"/*.comp; do
  name="$(basename "$src" .comp)"
  glslc --target-env=vulkan1.2 -O -I "$here" "$src" -o "$out/$name.spv"
done
