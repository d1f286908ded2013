#!/usr/bin/env bash
# Prints foxedge.pc for an install prefix ($1), following cargo-c's layout:
# ${prefix}/lib/libfoxedge.{so,a}, ${prefix}/include/foxedge/foxedge.h.
# Libs.private lists the system libraries the Rust static library needs: $2, as printed by
# `rustc --print native-static-libs` for libfoxedge.a (ci.sh passes it); without $2, those
# of an empty Rust static library (enough only for a build without Vulkan).
set -euo pipefail
prefix="${1:?usage: pkgconfig.sh PREFIX [NATIVE_STATIC_LIBS]}"
native="${2:-}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -n1)"
if [ -z "$native" ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  echo '' >"$tmp/empty.rs"
  native="$(rustc --crate-type staticlib --crate-name probe --print native-static-libs \
    -o "$tmp/libprobe.a" "$tmp/empty.rs" 2>&1 | sed -n 's/.*native-static-libs: //p' | head -n1)"
fi
cat <<PC
prefix=$prefix
exec_prefix=\${prefix}
libdir=\${exec_prefix}/lib
includedir=\${prefix}/include

Name: foxedge
Description: Forgetting Attention (FoX) inference with ACP and a certified retention cache (C ABI)
Version: $version
Libs: -L\${libdir} -lfoxedge
Libs.private: $native
Cflags: -I\${includedir}/foxedge
PC
